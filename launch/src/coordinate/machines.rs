//! [`Machines`]: the coordination of one of several machines' launchers.
//! Machine 0 hosts the store for the whole run, the others are its
//! clients; every attempt starts with the machines' join (`membership.rs`,
//! or in an elastic run a round, `elastic.rs`), runs under the launchers'
//! heartbeats (`liveness.rs`) and ends with an outcome every machine
//! agrees on. Machine 0 also hosts, for each attempt, a fresh torch
//! endpoint on its address and a free port, which torch workers on every
//! machine join (MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, as torchrun's
//! agent store; torch expects a new store per attempt).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::worker::{tcp_url, WorkerEnv};
use accel_api::{Error, ErrorKind, Result, Store};
use accel_rendezvous::{TcpStore, TcpStoreServer, TorchStoreServer};

use super::etcd::{self, EtcdRendezvous};
use super::liveness::{lost_failure, Liveness, StoreSite, BEAT, SUSPECT};
use super::membership::{self, Global, MachineSlot, Plan, Registration, Watcher};
use super::{elastic, host_name, read_stall, Coordinator, Settled};
use crate::event::{Event, LAST_SIGNAL};
use crate::group::Attempt;
use crate::output::say;
use crate::report::{self, Exit, Failure, Status};
use crate::store;
use crate::supervise::LocalOutcome;

/// What one machine's launcher brings to a run over several machines.
#[derive(Debug, Clone)]
pub struct MachinesConfig {
    /// This machine's rank (machine 0 hosts the store).
    pub machine_rank: usize,
    /// Workers on this machine.
    pub nproc: usize,
    /// Machines in the run (the most, in an elastic run).
    pub num_machines: usize,
    /// The fewest machines an elastic run goes on with (`num_machines`
    /// when it is not elastic).
    pub min_machines: usize,
    /// How long an elastic round stays open once `min_machines` joined.
    pub join_window: Duration,
    /// Bound of the machines' join.
    pub join_timeout: Duration,
    /// The workers' bound of every blocking call (ACCEL_TIMEOUT): a machine
    /// silent for it and 2 s more is lost, and an elastic round waits that
    /// long for the other machines' results.
    pub timeout: Duration,
    /// Machine 0's address, where the store listens.
    pub main_addr: String,
    /// The store's port; machine 0 may pass 0 for a free one (then
    /// [`Machines::port`] says which, for the other machines).
    pub main_port: u16,
    /// The run id asked for, if any (machine 0's, or a random one, rules).
    pub run_id: Option<String>,
    /// Restarts allowed (machine 0's rule every machine).
    pub max_restarts: u32,
    /// What every worker of this machine shares (timeout, backend, ...);
    /// the store, the run id, the ranks and the restart count are filled
    /// in per attempt.
    pub base: WorkerEnv,
    /// Where error-file directories go.
    pub scratch: PathBuf,
    /// No machine rank was given (torchrun's c10d rendezvous): the launcher
    /// that can listen at the store's address hosts it and is machine 0,
    /// the others take the next ranks from the store in the order they
    /// join ([`Machines::join`]); `machine_rank` is ignored.
    pub auto_rank: bool,
    /// The run's store is on an etcd cluster (`--rdzv-backend etcd`): no
    /// machine hosts it, each round elects its machine 0 (`etcd.rs`);
    /// `machine_rank`, `main_addr` and `main_port` are not used, `run_id`
    /// is required.
    pub etcd: Option<EtcdRendezvous>,
}

impl MachinesConfig {
    /// `true` for `--num-machines MIN:MAX` with `MIN < MAX`.
    pub fn elastic(&self) -> bool {
        self.min_machines < self.num_machines
    }

    /// The world size this machine claims when it joins: every machine
    /// runs [`nproc`](Self::nproc).
    pub fn world_size_claim(&self) -> usize {
        self.nproc * self.num_machines
    }
}

/// The key under which machine 0 publishes the port of its torch endpoint
/// of attempt `n` (in accel's store, which only the run's token reaches).
fn torch_port_key(n: u32) -> String {
    format!("accel-launch/a{n}/torch-port")
}

/// One of several machines' launchers. Machine 0 hosts the store for the
/// whole run, the others are its clients; every attempt begins with the
/// machines' join (in an elastic run, a round), runs under the launchers'
/// heartbeats, and ends with an outcome every machine agrees on: the first
/// root cause published anywhere, a lost machine named as the cause.
/// Machine 0 also hosts a fresh torch endpoint per attempt, which torch
/// workers on every machine join. [`Machines::join`] builds one;
/// [`accel_launch::run`](crate::run) drives it.
pub struct Machines {
    cfg: MachinesConfig,
    me: Registration,
    server: Option<TcpStoreServer>,
    torch: Option<TorchStoreServer>,
    store: Arc<dyn Store>,
    run_id: String,
    max_restarts: u32,
    host: String,
    base: WorkerEnv,
    watcher: Option<Watcher>,
    /// The round (attempt) whose keys this machine uses: its attempt number,
    /// or in an elastic run the round it joined.
    round: u32,
    /// This machine's rank in the round.
    rank: usize,
    /// Machines in the round.
    count: usize,
    /// Rounds this machine missed (it joined late): its attempt number is
    /// `round - lag`.
    lag: u32,
    /// The ids of the last round's machines, in rank order (machine 0).
    members: Vec<String>,
    /// The last round's machines.
    slots: Vec<MachineSlot>,
    /// The heartbeats' own connection to the store.
    beat_store: Arc<dyn Store>,
    liveness: Option<Liveness>,
    plan: Option<Plan>,
}

impl std::fmt::Debug for Machines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Machines")
            .field("machine_rank", &self.cfg.machine_rank)
            .field("store", &self.store_at())
            .field("run_id", &self.run_id)
            .field("round", &self.round)
            .field("rank", &self.rank)
            .field("count", &self.count)
            .finish_non_exhaustive()
    }
}

/// Connect to machine 0's store (and a second connection for the
/// heartbeats), within the join timeout.
///
/// # Errors
/// The store cannot be reached in time, or refuses the token (naming the
/// fix).
fn connect_to_machine_0(
    cfg: &MachinesConfig,
    token: &str,
) -> Result<(Arc<dyn Store>, Arc<dyn Store>)> {
    let addr = tcp_url(&cfg.main_addr, cfg.main_port);
    let addr = addr.trim_start_matches("tcp://").to_string();
    let who = if cfg.auto_rank {
        "this machine".to_string()
    } else {
        format!("machine {}", cfg.machine_rank)
    };
    let c = TcpStore::connect(addr.as_str(), Some(token), cfg.join_timeout).map_err(|e| {
        if matches!(e.kind(), ErrorKind::Unauthorized) {
            Error::new(
                ErrorKind::Unauthorized,
                format!(
                    "{who} cannot join the run: machine 0's store at {addr} refused this \
                     machine's token"
                ),
            )
            .with_op("machine join")
            .with_fix("pass the same token (--token-file, ACCEL_RUN_TOKEN, or `token` in the config file) on every machine")
            .with_source(e)
        } else {
            e.with_op("machine join")
        }
    })?;
    // Short: a beat must not outlive the lost threshold by much.
    let beat = TcpStore::connect(addr.as_str(), Some(token), SUSPECT)
        .map_err(|e| e.with_op("machine join"))?;
    Ok((Arc::new(c), Arc::new(beat)))
}

/// The store key of the machine ranks handed out (torchrun's c10d).
const NEXT_RANK_KEY: &str = "accel-launch/next-machine-rank";

/// This machine's rank, handed out by machine 0's store in join order
/// (1, 2, ...: machine 0 is the host).
///
/// # Errors
/// The store's; more launchers than `--nnodes` allows, naming the count.
fn next_machine_rank(store: &dyn Store, cfg: &MachinesConfig) -> Result<usize> {
    let n = store
        .add(NEXT_RANK_KEY, 1)
        .map_err(|e| e.with_op("machine join"))?;
    let rank = usize::try_from(n).unwrap_or(usize::MAX);
    if rank >= cfg.num_machines {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "this launcher would be machine {rank}, but the run has {} machines: more \
                 launchers joined than --nnodes allows",
                cfg.num_machines
            ),
        )
        .with_op("machine join")
        .with_fix("start one accel launch per machine, or raise --nnodes"));
    }
    Ok(rank)
}

/// This machine's address on the route to `endpoint` (`host:port`): a UDP
/// "connect" sends nothing, it asks the kernel for the source address.
fn route_towards(endpoint: &str) -> Option<String> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect(endpoint).ok()?;
    Some(s.local_addr().ok()?.ip().to_string())
}

/// What this machine tells the others when it joins (`cfg.machine_rank`
/// as known now).
fn registration(cfg: &MachinesConfig, host: &str) -> Result<Registration> {
    Ok(Registration {
        machine_rank: cfg.machine_rank,
        nproc: cfg.nproc,
        num_machines: cfg.num_machines,
        world_size: cfg.world_size_claim(),
        run_id: cfg.run_id.clone(),
        host: host.to_string(),
        pid: std::process::id(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        id: format!("{host}:{}:{}", std::process::id(), store::random_hex(4)?),
        min_machines: cfg.min_machines,
    })
}

impl Machines {
    /// Host the store (machine 0) or connect to it (the others) with
    /// `token`; the join itself happens at each attempt's
    /// [`begin`](Coordinator::begin).
    ///
    /// # Errors
    /// Machine 0 cannot bind its address and port; another machine cannot
    /// reach the store within the join timeout, or the store refuses its
    /// token (naming the fix).
    pub fn join(mut cfg: MachinesConfig, token: &str) -> Result<Machines> {
        let host = host_name();
        if cfg.etcd.is_some() {
            return Self::join_etcd(cfg, host);
        }
        // torchrun's c10d: whoever can listen at the endpoint hosts.
        let hosted = if cfg.auto_rank {
            match store::host(&cfg.main_addr, cfg.main_port, true, token) {
                Ok((server, _)) => {
                    cfg.machine_rank = 0;
                    Some(server)
                }
                // Taken (another launcher here hosts) or another machine's
                // address: join as one of the others.
                Err(e) if e.op() == Some("store bind") => {
                    cfg.machine_rank = usize::MAX;
                    None
                }
                Err(e) => return Err(e),
            }
        } else if cfg.machine_rank == 0 {
            Some(store::host(&cfg.main_addr, cfg.main_port, true, token)?.0)
        } else {
            None
        };
        let (server, store, beat_store) = match hosted {
            Some(server) => {
                // Port 0: the one the kernel chose, for the workers' URL.
                cfg.main_port = server.local_addr().port();
                let st: Arc<dyn Store> = server.store().clone();
                (Some(server), st.clone(), st)
            }
            None => {
                let (store, beat) = connect_to_machine_0(&cfg, token)?;
                if cfg.auto_rank {
                    cfg.machine_rank = next_machine_rank(&*store, &cfg)?;
                }
                (None, store, beat)
            }
        };
        let me = registration(&cfg, &host)?;
        let run_id = match (cfg.machine_rank, &cfg.run_id) {
            (0, Some(id)) => id.clone(),
            (0, None) => store::random_hex(6)?,
            _ => String::new(), // machine 0 decides
        };
        let mut base = cfg.base.clone();
        base.run_id = Some(run_id.clone());
        base.master_addr = Some(cfg.main_addr.clone());
        base.master_port = Some(cfg.main_port);
        base.store_url = Some(tcp_url(&cfg.main_addr, cfg.main_port));
        base.token = Some(token.to_string());
        Ok(Machines::new(
            cfg,
            me,
            (server, store, beat_store),
            (run_id, host, base),
        ))
    }

    /// [`join`](Self::join) on an etcd cluster: connect, and learn the
    /// machine rank from each round's plan.
    fn join_etcd(mut cfg: MachinesConfig, host: String) -> Result<Machines> {
        let (Some(rdzv), Some(run_id)) = (cfg.etcd.clone(), cfg.run_id.clone()) else {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "an etcd rendezvous needs a run id (--rdzv-id) shared by every machine of the run",
            ));
        };
        // A call that does not wait for a key is answered within an
        // election (about a second) on a cluster with a quorum: 5 s at most,
        // so that a lost quorum ends the attempt soon.
        let call = cfg.timeout.min(Duration::from_secs(5));
        let bounds = (cfg.join_timeout, call, SUSPECT);
        let (store, beat_store) = rdzv.connect(&run_id, bounds)?;
        // Unknown until the first round's plan.
        cfg.machine_rank = usize::MAX;
        let me = registration(&cfg, &host)?;
        let mut base = cfg.base.clone();
        base.run_id = Some(run_id.clone());
        base.master_addr = None;
        base.master_port = None;
        base.store_url = Some(rdzv.url(&run_id));
        base.token = None;
        let stores = (None, store, beat_store);
        Ok(Machines::new(cfg, me, stores, (run_id, host, base)))
    }

    /// A coordinator before its first round: `stores` are the hosted
    /// server (machine 0), the store and the heartbeats' store.
    fn new(
        cfg: MachinesConfig,
        me: Registration,
        (server, store, beat_store): (Option<TcpStoreServer>, Arc<dyn Store>, Arc<dyn Store>),
        (run_id, host, base): (String, String, WorkerEnv),
    ) -> Machines {
        Machines {
            me,
            server,
            torch: None,
            store,
            run_id,
            max_restarts: cfg.max_restarts,
            host,
            base,
            watcher: None,
            round: 0,
            rank: cfg.machine_rank,
            count: cfg.num_machines,
            lag: 0,
            members: Vec::new(),
            slots: Vec::new(),
            beat_store,
            liveness: None,
            plan: None,
            cfg,
        }
    }

    /// This machine hosts the store or, on etcd, leads the current round.
    fn leads(&self) -> bool {
        match self.cfg.etcd {
            Some(_) => self.rank == 0,
            None => self.cfg.machine_rank == 0,
        }
    }

    /// The port machine 0's store listens on (the one it chose when given
    /// 0): what the other machines pass as their `main_port`.
    pub fn port(&self) -> u16 {
        self.cfg.main_port
    }

    /// Where the run's store is (for messages): machine 0's address, or
    /// the etcd cluster.
    fn store_at(&self) -> StoreSite {
        if self.cfg.etcd.is_some() {
            return StoreSite::Cluster(self.store.describe());
        }
        StoreSite::Machine0(
            tcp_url(&self.cfg.main_addr, self.cfg.main_port)
                .trim_start_matches("tcp://")
                .to_string(),
        )
    }

    /// `f` as the loss of a silent machine, when `f` speaks of a lost or
    /// late peer and a machine went silent: waits up to
    /// [`SUSPECT`] (and two beats) for the silence to show, as
    /// the ranks of a killed machine's peers fail at once.
    fn attribute(&self, f: &Failure) -> Failure {
        let (Some(live), Some(plan)) = (&self.liveness, &self.plan) else {
            return f.clone();
        };
        if !f.speaks_of_a_peer() {
            return f.clone();
        }
        let deadline = Instant::now() + SUSPECT + 2 * BEAT;
        loop {
            // Cut off, or another machine's cause is already out: no wait.
            if !live.reaches_store() || membership::failure(&*self.beat_store, self.round).is_some()
            {
                return f.clone();
            }
            let silent = live.silent(SUSPECT);
            if !silent.is_empty() {
                return lost_failure(plan, self.rank, &silent, &self.store_at(), Some(f));
            }
            if Instant::now() > deadline {
                return f.clone();
            }
            std::thread::sleep(BEAT / 2);
        }
    }

    /// `false` once this machine's heartbeat stopped reaching the store:
    /// then nothing waits on the store any more.
    fn reaches_store(&self) -> bool {
        self.liveness.as_ref().is_none_or(Liveness::reaches_store)
    }

    /// The attempt's end on a machine that lost the store (and so the
    /// others): named as this machine losing the others, without waiting
    /// on the store. `None` without a plan (no attempt began).
    fn settle_alone(&self, local: &LocalOutcome) -> Option<Settled> {
        let (live, plan) = (self.liveness.as_ref()?, self.plan.as_ref()?);
        let root = match local {
            LocalOutcome::Interrupted(_) | LocalOutcome::Succeeded => return None,
            LocalOutcome::Remote(f) if matches!(f.exit, Exit::Lost { .. }) => (**f).clone(),
            other => {
                let witness = match other {
                    LocalOutcome::Failed { root: Some(f), .. } | LocalOutcome::Remote(f) => {
                        Some((**f).clone())
                    }
                    _ => None,
                };
                let me = self.rank;
                let silent = vec![(me, live.own_silence())];
                let mut f = lost_failure(plan, me, &silent, &self.store_at(), witness.as_ref());
                if let LocalOutcome::StoreLost(why) = other {
                    let e = f.error.get_or_insert_with(String::new);
                    e.push_str(&format!("\n{why}"));
                }
                f
            }
        };
        Some(Settled {
            status: Status::Failed,
            code: root.exit.launcher_code(),
            root: Some(root),
            interrupted_by: None,
            restartable: false,
        })
    }

    /// Join round `n` (or, elastic and not machine 0, the first open round
    /// from `n + lag` on): `(rank offset, world size)`.
    fn join_round(&mut self, n: u32) -> Result<(usize, usize)> {
        let s = self.cfg.clone();
        if s.etcd.is_none() && !s.elastic() {
            let plan = if s.machine_rank == 0 {
                membership::host_join(
                    &*self.store,
                    &self.me,
                    &self.run_id,
                    s.max_restarts,
                    n,
                    s.join_timeout,
                )?
            } else {
                membership::member_join(&*self.store, &self.me, n, s.join_timeout)?
            };
            self.round = n;
            self.take_plan(&plan);
            let off = plan
                .machines
                .get(s.machine_rank)
                .map(|m| m.rank_offset)
                .unwrap_or(s.machine_rank * s.nproc);
            return Ok((off, plan.world_size));
        }
        let bounds = elastic::Bounds {
            min: s.min_machines,
            max: s.num_machines,
            window: s.join_window,
            timeout: s.join_timeout,
        };
        let (round, plan) = if s.etcd.is_some() {
            let previous = std::mem::take(&mut self.members);
            etcd::join_round(
                &*self.store,
                &self.me,
                (&self.run_id, s.max_restarts),
                n + self.lag,
                &previous,
                bounds,
            )?
        } else if s.machine_rank == 0 {
            let previous = std::mem::take(&mut self.members);
            let plan = elastic::host_round(
                &*self.store,
                &self.me,
                (&self.run_id, s.max_restarts),
                n,
                &previous,
                bounds,
            )?;
            (n, plan)
        } else {
            elastic::member_round(&*self.store, &self.me, n + self.lag, s.join_timeout)?
        };
        self.round = round;
        self.lag = round - n;
        self.take_plan(&plan);
        let slot = plan
            .machines
            .iter()
            .find(|m| m.id == self.me.id)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Backend,
                    format!("round {round}'s plan does not hold this machine"),
                )
            })?;
        self.rank = slot.machine_rank;
        Ok((slot.rank_offset, plan.world_size))
    }

    fn take_plan(&mut self, plan: &Plan) {
        if self.cfg.machine_rank != 0 || self.cfg.etcd.is_some() {
            self.run_id = plan.run_id.clone();
            self.max_restarts = plan.max_restarts;
        }
        self.count = plan.machines.len();
        self.members = plan.machines.iter().map(|m| m.id.clone()).collect();
        self.slots = plan.machines.clone();
        self.plan = Some(plan.clone());
    }

    /// The root cause when machines `missing` of an elastic round did not
    /// report the end of their workers within `--timeout`.
    fn silent(&self, missing: &[usize]) -> Failure {
        let k = missing[0];
        let slot = self.slots.get(k);
        let host = slot.map_or_else(|| "?".to_string(), |m| m.host.clone());
        Failure {
            rank: slot.map_or(0, |m| m.rank_offset),
            local_rank: 0,
            machine: k,
            host: host.clone(),
            pid: None,
            exit: Exit::Code { code: 1 },
            error: Some(format!(
                "machine {k} ({host}) did not report the end of its workers within {:?} of this machine's: its launcher froze or was lost (machine(s) {} silent)",
                self.cfg.timeout,
                missing
                    .iter()
                    .map(|m| m.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            location: None,
            stderr_tail: Vec::new(),
            also_hung: Vec::new(),
            interrupted: false,
        }
    }

    /// Machine 0: a fresh torch endpoint for attempt `n`, its port
    /// published before the join.
    fn host_torch(&mut self, n: u32) -> Result<u16> {
        if let Some(old) = self.torch.take() {
            old.shutdown();
        }
        let (t, _) = store::host_torch(&self.cfg.main_addr, 0, true)?;
        let port = t.local_addr().port();
        self.torch = Some(t);
        self.store
            .set(&torch_port_key(n), port.to_string().as_bytes())?;
        Ok(port)
    }

    /// On etcd, after the join: the torch endpoint of the round, which its
    /// leader hosts on its address towards the cluster's first member and
    /// publishes (`addr:port`); the others wait for it within the join
    /// timeout.
    fn etcd_torch_endpoint(&mut self) -> Result<(String, u16)> {
        let k = torch_port_key(self.round);
        if self.rank == 0 {
            if let Some(old) = self.torch.take() {
                old.shutdown();
            }
            let first = self.cfg.etcd.as_ref().and_then(|e| e.endpoints.first());
            let addr = first
                .and_then(|ep| route_towards(ep))
                .unwrap_or_else(|| "127.0.0.1".into());
            let (t, _) = store::host_torch(&addr, 0, true)?;
            let port = t.local_addr().port();
            self.torch = Some(t);
            self.store.set(&k, format!("{addr} {port}").as_bytes())?;
            return Ok((addr, port));
        }
        let raw = self.store.get(&k, self.cfg.join_timeout)?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        text.split_once(' ')
            .and_then(|(a, p)| Some((a.to_string(), p.trim().parse().ok()?)))
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Corrupt,
                    format!(
                        "round {}'s torch endpoint in the store is {text:?}",
                        self.round
                    ),
                )
            })
    }

    /// Another machine, after the join of attempt `n`: the port machine 0
    /// published (`None` from a machine 0 that hosts no torch endpoint, an
    /// older accel).
    fn joined_torch_port(&self, n: u32) -> Result<Option<u16>> {
        Ok(self
            .store
            .try_get(&torch_port_key(n))?
            .and_then(|v| String::from_utf8(v).ok())
            .and_then(|p| p.trim().parse().ok()))
    }

    /// The record a launcher publishes when it is interrupted, so that the
    /// other machines stop too (and do not restart).
    fn interruption(&self, rank_offset: usize, sig: i32) -> Failure {
        Failure {
            rank: rank_offset,
            local_rank: 0,
            machine: self.rank,
            host: self.host.clone(),
            pid: Some(std::process::id()),
            exit: Exit::Signal { signal: sig },
            error: Some(format!(
                "the launcher on machine {} ({}) received {}",
                self.rank,
                self.host,
                report::signal_name(sig)
            )),
            location: None,
            stderr_tail: Vec::new(),
            also_hung: Vec::new(),
            interrupted: true,
        }
    }
}

impl Coordinator for Machines {
    fn begin(&mut self, n: u32, tx: &Sender<Event>) -> Result<Attempt> {
        // Machine 0 hosts a fresh torch endpoint for each attempt (torch
        // expects a new store on a retry) and publishes its port before
        // the join; the others read it after.
        // On etcd the round's leader hosts it after the join, on its
        // address towards the cluster, and the others wait for it.
        let on_etcd = self.cfg.etcd.is_some();
        let mut torch_port = if self.cfg.machine_rank == 0 && !on_etcd {
            Some(self.host_torch(n)?)
        } else {
            None
        };
        let (rank_offset, world_size) = self.join_round(n)?;
        let mut torch_addr = None;
        if on_etcd {
            let (addr, port) = self.etcd_torch_endpoint()?;
            (torch_addr, torch_port) = (Some(addr), Some(port));
        } else if self.cfg.machine_rank != 0 {
            torch_port = self.joined_torch_port(self.round)?;
        }
        if let Some(l) = self.liveness.take() {
            l.stop();
        }
        self.liveness = self.plan.clone().map(|plan| {
            let (store, tx, me) = (self.beat_store.clone(), tx.clone(), self.rank);
            let at = self.store_at();
            let (attempt, round) = (n, self.round);
            Liveness::start(
                self.beat_store.clone(),
                self.round,
                me,
                self.count,
                self.cfg.timeout + Duration::from_secs(2),
                Box::new(move |lost, why| {
                    // This machine's own silence: the store is out of reach,
                    // and so are the others; settle_alone names them.
                    if let Some((k, silent)) = lost.first().filter(|(k, _)| *k == me) {
                        let why = why.map(|w| format!(": {w}")).unwrap_or_default();
                        let _ = tx.send(Event::StoreLost {
                            attempt,
                            message: format!(
                                "machine {k}'s heartbeat has not reached the store at {at} for {:.1}s{why}",
                                silent.as_secs_f64()
                            ),
                        });
                        return;
                    }
                    let f = lost_failure(&plan, me, &lost, &at, None);
                    let first = membership::publish_failure(&*store, round, &f).unwrap_or(f);
                    let _ = tx.send(Event::Remote {
                        attempt,
                        failure: Box::new(first),
                    });
                }),
            )
        });
        self.watcher = Some(Watcher::start(
            self.store.clone(),
            self.round,
            self.rank,
            tx.clone(),
        ));
        let mut env = self.base.clone();
        if let Some(port) = torch_port {
            env.master_port = Some(port);
            env.agent_store = Some(true);
        }
        if torch_addr.is_some() {
            env.master_addr = torch_addr;
        }
        env.run_id = Some(self.run_id.clone());
        env.world_size = Some(world_size);
        env.group_rank = Some(self.rank);
        env.group_world_size = Some(self.count);
        env.restart_count = Some(self.round);
        env.max_restarts = Some(self.max_restarts);
        Ok(Attempt {
            number: self.round,
            env,
            rank_offset,
            error_dir: self.cfg.scratch.join(format!("attempt-{n}")),
            host: self.host.clone(),
        })
    }

    fn publish(&self, _n: u32, f: &Failure) {
        let f = self.attribute(f);
        if self.reaches_store() {
            membership::publish_failure(&*self.store, self.round, &f);
        }
    }

    fn settle(&mut self, _n: u32, attempt: &Attempt, local: LocalOutcome) -> Settled {
        if let Some(w) = self.watcher.take() {
            w.stop();
        }
        if !self.reaches_store() || matches!(local, LocalOutcome::StoreLost(_)) {
            if let Some(settled) = self.settle_alone(&local) {
                return settled;
            }
        }
        let (st, me, m, n) = (&*self.store, self.rank, self.count, self.round);
        let failed = |root: Failure| Settled {
            status: Status::Failed,
            code: root.exit.launcher_code(),
            root: Some(root),
            interrupted_by: None,
            restartable: true,
        };
        let lost = |why: String| Settled {
            status: Status::Failed,
            root: None,
            code: 1,
            interrupted_by: Some(format!("lost store: {why}")),
            restartable: false,
        };
        match local {
            LocalOutcome::Interrupted(sig) => {
                let f = self.interruption(attempt.rank_offset, sig);
                membership::publish_failure(st, n, &f);
                let _ = membership::settle(st, n, me, m, false);
                Settled::alone(LocalOutcome::Interrupted(sig))
            }
            LocalOutcome::StoreLost(why) => lost(why),
            local => {
                let ok = matches!(local, LocalOutcome::Succeeded);
                let limit = self.cfg.elastic().then_some(self.cfg.timeout);
                match (membership::settle_within(st, n, (me, m), ok, limit), local) {
                    (Global::Missing(missing), _) => {
                        // Everyone agrees on one root cause: the first published.
                        let f = self.silent(&missing);
                        failed(membership::publish_failure(st, n, &f).unwrap_or(f))
                    }
                    (Global::Succeeded, _) => Settled::alone(LocalOutcome::Succeeded),
                    (Global::Failed(f), _) if f.interrupted => {
                        say(&format!(
                            "the run was stopped on machine {} ({})",
                            f.machine,
                            f.error.as_deref().unwrap_or("interrupted")
                        ));
                        let sig = LAST_SIGNAL.load(Ordering::SeqCst);
                        Settled {
                            status: Status::Interrupted,
                            code: if sig != 0 {
                                u8::try_from(128 + sig).unwrap_or(1)
                            } else {
                                f.exit.launcher_code()
                            },
                            root: Some(*f),
                            interrupted_by: Some("another machine's launcher".into()),
                            restartable: false,
                        }
                    }
                    (Global::Failed(f), _) => failed(*f),
                    (
                        Global::StoreLost(why),
                        LocalOutcome::Failed { root: Some(f), .. } | LocalOutcome::Remote(f),
                    ) => {
                        say(&format!("lost the store on machine 0: {why}"));
                        Settled {
                            restartable: false,
                            ..failed(*f)
                        }
                    }
                    (Global::StoreLost(why), _) => {
                        // Waiting for the other machines was cut short by a signal.
                        let sig = LAST_SIGNAL.load(Ordering::SeqCst);
                        if sig != 0 {
                            Settled::alone(LocalOutcome::Interrupted(sig))
                        } else {
                            lost(why)
                        }
                    }
                }
            }
        }
    }

    /// In rounds: a machine that joined late has `lag` fewer attempts.
    fn max_restarts(&self) -> u32 {
        self.max_restarts.saturating_sub(self.lag)
    }

    fn end(&mut self, _last: u32) {
        let reaches = self.reaches_store();
        if reaches && self.leads() && (self.cfg.elastic() || self.cfg.etcd.is_some()) {
            // Machines waiting for a round stop (on etcd, a later launcher
            // with the same run id learns the run is over).
            let _ = self
                .store
                .set(&elastic::done_key(), b"machine 0's launcher ended the run");
        }
        // Wait for no goodbye of a silent machine, nor of the machine the
        // root cause says was lost (it may have gone silent a moment ago);
        // say none to a store this machine cannot reach.
        let lost = (reaches && self.rank == 0)
            .then(|| membership::failure(&*self.store, self.round))
            .flatten()
            .filter(|f| matches!(f.exit, Exit::Lost { .. }))
            .map(|f| f.machine);
        let awaited: Vec<usize> = match &self.liveness {
            Some(l) => {
                let silent = l.silent(SUSPECT);
                (0..self.count)
                    .filter(|k| !silent.iter().any(|(s, _)| s == k) && lost != Some(*k))
                    .collect()
            }
            // No attempt began: no machine joined to say goodbye.
            None => Vec::new(),
        };
        if reaches {
            membership::farewell(
                &*self.store,
                self.round,
                self.rank,
                &awaited,
                Duration::from_secs(5),
            );
        }
        if let Some(l) = self.liveness.take() {
            l.stop();
        }
        if let Some(server) = self.server.take() {
            server.shutdown();
        }
        if let Some(t) = self.torch.take() {
            t.shutdown();
        }
    }

    fn store_url(&self) -> String {
        if let Some(url) = self
            .base
            .store_url
            .clone()
            .filter(|_| self.cfg.etcd.is_some())
        {
            return url;
        }
        tcp_url(&self.cfg.main_addr, self.cfg.main_port)
    }

    fn stall(&self, attempt: &Attempt) -> Option<report::Stall> {
        if !self.reaches_store() {
            return None;
        }
        read_stall(self.store.clone(), attempt)
    }

    fn place(&self, rank: usize) -> Option<(usize, usize, String)> {
        let slot = self
            .plan
            .as_ref()?
            .machines
            .iter()
            .find(|m| (m.rank_offset..m.rank_offset + m.nproc).contains(&rank))?;
        Some((
            rank - slot.rank_offset,
            slot.machine_rank,
            slot.host.clone(),
        ))
    }
}
