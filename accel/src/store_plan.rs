//! Where a process's rendezvous store is and how it is opened
//! ([`ProcessState::store_location`], [`ProcessState::store_plan`],
//! [`ProcessState::open_store`]), including the torch-protocol store rank
//! 0 hosts when the environment names one by MASTER_ADDR/MASTER_PORT only.

use std::sync::Arc;

use accel_api::{Error, ErrorKind, Result};

use crate::state::{rank_thread_store, LaunchSource, ProcessState};
use crate::worker_env::{keys, tcp_url};

/// The store a process opens ([`ProcessState::store_plan`]).
pub enum StorePlan {
    /// The store the rank threads of this process share.
    Shared(Arc<dyn accel_api::Store>),
    /// A fresh in-memory store (one process, no store named).
    Memory,
    /// The store at this URL (its form checked).
    Url(String),
    /// None: an MPI launcher or srun started the run without naming a
    /// store; the first use fails with this error (the mpi backend needs
    /// none).
    Deferred(Error),
}

impl std::fmt::Debug for StorePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StorePlan::Shared(_) => f.write_str("Shared"),
            StorePlan::Memory => f.write_str("Memory"),
            StorePlan::Url(u) => write!(f, "Url({u})"),
            StorePlan::Deferred(e) => write!(f, "Deferred({e})"),
        }
    }
}

impl ProcessState {
    /// The rendezvous store's URL: ACCEL_STORE_URL; else, from MASTER_ADDR
    /// and MASTER_PORT, accel's own store (`tcp://`) when the run has a
    /// token, and otherwise a store speaking torch's TCPStore protocol
    /// (`torch://`: torchrun's agent store, or one rank 0 hosts); `None` for
    /// a one-process run without either.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for a multi-process run that names no store.
    pub fn store_location(&self) -> Result<Option<String>> {
        if let Some(u) = &self.store_url {
            return Ok(Some(u.clone()));
        }
        if let Some(a) = self.master_addr.as_deref().filter(|a| a.trim().is_empty()) {
            return Err(Error::invalid_config(
                keys::MASTER_ADDR,
                a,
                "MASTER_ADDR is set but empty: an empty address is refused, not read as unset \
                 or as this machine",
            )
            .with_fix(
                "set MASTER_ADDR to machine 0's address (127.0.0.1 on one machine), or unset it",
            ));
        }
        match (&self.master_addr, self.master_port) {
            (Some(a), Some(p)) if self.token.is_some() => Ok(Some(tcp_url(a, p))),
            (Some(a), Some(p)) if self.world_size > 1 || self.agent_store => {
                Ok(Some(format!("torch{}", &tcp_url(a, p)[3..])))
            }
            _ if self.world_size == 1 => Ok(None),
            (None, _) => Err(Error::new(
                ErrorKind::InvalidConfig,
                format!("WORLD_SIZE={} but MASTER_ADDR is not set", self.world_size),
            )
            .with_fix(FIX_NO_STORE)),
            (Some(_), None) => Err(Error::new(
                ErrorKind::InvalidConfig,
                format!("WORLD_SIZE={} but MASTER_PORT is not set", self.world_size),
            )
            .with_fix(FIX_NO_STORE)),
            // One process, no token, no agent store: nothing to meet.
            (Some(_), Some(_)) => Ok(None),
        }
    }

    /// Whether this rank hosts the run's store: rank 0 of a run whose store
    /// is derived from MASTER_ADDR/MASTER_PORT without a token and without
    /// torchrun's agent store (Kubeflow's PyTorchJob, variables set by hand,
    /// plain mpirun or srun with MASTER_ADDR), as torch's `env://` does.
    pub fn hosts_store(&self) -> bool {
        self.rank == 0
            && self.store_url.is_none()
            && self.token.is_none()
            && !self.agent_store
            && self.world_size > 1
            && self.master_addr.is_some()
            && self.master_port.is_some()
    }

    /// Open the run's rendezvous store: the one at
    /// [`store_location`](Self::store_location) with the run token, or a
    /// fresh in-memory store for a one-process run that names none.
    ///
    /// A multi-process run started by an MPI launcher or srun directly
    /// (`mpirun -n 2 prog`, no `MASTER_ADDR`) names no store either: the
    /// `mpi` backend bootstraps through MPI and needs none. It gets a
    /// store that is opened never and fails on first use with the
    /// [`store_location`](Self::store_location) error, so a backend or
    /// feature that does need one (cpu-gloo, debug mode) still says to set
    /// `MASTER_ADDR` (docs/adr/0008-launch-library.md).
    ///
    /// # Errors
    /// As [`store_location`](Self::store_location) (except in the case
    /// above), plus the store's connect errors (unreachable, wrong token),
    /// tagged with this rank.
    pub fn open_store(&self) -> Result<Arc<dyn accel_api::Store>> {
        match self.store_plan()? {
            StorePlan::Shared(store) => Ok(store),
            StorePlan::Memory => Ok(Arc::new(accel_rendezvous::MemoryStore::new())),
            StorePlan::Url(url) => {
                if let Some(why) = loopback_across_machines(self) {
                    crate::notice::warn(Some(self.rank), &why);
                }
                if self.hosts_store() {
                    host_torch_store(self).map_err(|e| e.with_rank(self.rank))?;
                }
                accel_rendezvous::open_store(&url, self.token.as_deref(), self.timeout)
                    .map_err(|e| e.with_rank(self.rank))
            }
            StorePlan::Deferred(why) => Ok(Arc::new(crate::no_store::NoStore { why })),
        }
    }

    /// Which store [`open_store`](Self::open_store) opens, with the URL's
    /// form checked and nothing opened (what `accel env` checks too).
    ///
    /// # Errors
    /// As [`store_location`](Self::store_location), and a malformed store
    /// URL (scheme, host, port range, relative path).
    pub fn store_plan(&self) -> Result<StorePlan> {
        if let Some(store) = rank_thread_store(self) {
            return Ok(StorePlan::Shared(store));
        }
        let checked = self.store_location().and_then(|loc| match loc {
            Some(url) => accel_rendezvous::check_store_url(&url)
                .map(|()| StorePlan::Url(url))
                .map_err(|e| e.with_rank(self.rank)),
            None => Ok(StorePlan::Memory),
        });
        match checked {
            Err(e) if self.mpi_launched || self.source == LaunchSource::Slurm => {
                Ok(StorePlan::Deferred(e.with_rank(self.rank)))
            }
            other => other,
        }
    }
}

/// A warning when MASTER_ADDR is a loopback address although the run has
/// ranks on other machines (WORLD_SIZE above LOCAL_WORLD_SIZE): those ranks
/// look for the store on their own machine and wait until the timeout.
/// torchrun writes `localhost` when its host name does not resolve to the
/// machine's address (containers, network namespaces): `--local-addr`
/// fixes it.
fn loopback_across_machines(s: &ProcessState) -> Option<String> {
    let addr = s.master_addr.as_deref()?;
    let host = addr.trim_start_matches('[').trim_end_matches(']');
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    (loopback && s.world_size > s.local_world_size && s.store_url.is_none()).then(|| {
        format!(
            "MASTER_ADDR={addr} is this machine's loopback address, but {} of the run's {} \
             ranks are on other machines: they cannot reach a store there and will wait until \
             the timeout. Under torchrun, pass --local-addr <this machine's address> (torchrun \
             writes `localhost` when the host name does not resolve to it); otherwise set \
             MASTER_ADDR to machine 0's address",
            s.world_size - s.local_world_size,
            s.world_size
        )
    })
}

const FIX_NO_STORE: &str = "set MASTER_ADDR and MASTER_PORT (rank 0 then hosts the store) or \
    ACCEL_STORE_URL (e.g. file:///shared/dir), or start with `accel launch` or torchrun";

/// The torch-protocol store rank 0 hosts for the life of the process.
static HOSTED: std::sync::Mutex<Option<accel_rendezvous::TorchStoreServer>> =
    std::sync::Mutex::new(None);

/// Host the run's store on MASTER_PORT, on MASTER_ADDR's interface when it
/// is one of this machine's, else on every interface (as torch does: a
/// Kubernetes service name resolves to the service's address, not the pod's).
fn host_torch_store(s: &ProcessState) -> Result<()> {
    let mut hosted = HOSTED.lock().unwrap_or_else(|p| p.into_inner());
    if hosted.is_some() {
        return Ok(());
    }
    let (Some(addr), Some(port)) = (&s.master_addr, s.master_port) else {
        return Ok(());
    };
    let host = addr.trim_start_matches('[').trim_end_matches(']');
    let mut tried = Vec::new();
    let candidates = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .map(|it| it.collect::<Vec<_>>())
        .unwrap_or_default();
    let any = std::net::SocketAddr::from(([0, 0, 0, 0], port));
    for a in candidates.into_iter().chain([any]) {
        match std::net::TcpListener::bind(a) {
            Ok(l) => {
                let server =
                    accel_rendezvous::TorchStoreServer::from_listener(l, Default::default())?;
                tracing::info!(addr = %server.local_addr(), "rank 0 hosts the run's store (MASTER_ADDR/MASTER_PORT)");
                *hosted = Some(server);
                return Ok(());
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!("rank 0 cannot host the run's store on MASTER_PORT={port}: the port is in use"),
                )
                .with_fix("pick a free MASTER_PORT, or stop what holds it (`ss -ltnp`)"));
            }
            Err(e) => tried.push(format!("{a}: {e}")),
        }
    }
    Err(Error::new(
        ErrorKind::InvalidConfig,
        format!(
            "rank 0 cannot host the run's store at MASTER_ADDR={addr} MASTER_PORT={port}: {}",
            tried.join("; ")
        ),
    )
    .with_fix("set MASTER_ADDR to an address of rank 0's machine"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(addr: &str, world: usize, local: usize) -> ProcessState {
        let vars = [
            ("RANK", "0".to_string()),
            ("LOCAL_RANK", "0".to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("LOCAL_WORLD_SIZE", local.to_string()),
            ("MASTER_ADDR", addr.to_string()),
            ("MASTER_PORT", "29500".to_string()),
            ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
        ];
        ProcessState::from_vars(
            vars.iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        )
        .unwrap()
    }

    /// torchrun in a container writes MASTER_ADDR=localhost on every node;
    /// the other machines' ranks would wait until the timeout in silence.
    #[test]
    fn a_loopback_master_addr_across_machines_is_warned_about() {
        for addr in ["localhost", "127.0.0.1", "[::1]", "LOCALHOST"] {
            let why = loopback_across_machines(&state(addr, 4, 2)).expect(addr);
            assert!(why.contains("2 of the run's 4 ranks"), "{why}");
            assert!(why.contains("--local-addr"), "{why}");
        }
        assert_eq!(loopback_across_machines(&state("localhost", 2, 2)), None);
        assert_eq!(loopback_across_machines(&state("10.0.0.1", 4, 2)), None);
    }
}
