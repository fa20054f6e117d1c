use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::{Communicator, Device, DeviceKind, Result, Store};

/// Priority of PJRT/XLA backends (probed first).
pub const PRIORITY_XLA: i32 = 500;
/// Priority of Ascend NPU backends.
pub const PRIORITY_NPU: i32 = 400;
/// Priority of CUDA backends.
pub const PRIORITY_CUDA: i32 = 300;
/// Priority of MPI when the process was started by an MPI launcher.
pub const PRIORITY_MPI: i32 = 200;
/// Priority of CPU collective engines (cpu-gloo).
pub const PRIORITY_CPU: i32 = 100;
/// Priority of the built-in `single` backend, the last resort.
pub const PRIORITY_FALLBACK: i32 = 0;

/// Whether a backend can run in this process.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "status", rename_all = "lowercase")]
pub enum Availability {
    /// The backend can connect.
    Available,
    /// The backend cannot connect here.
    Unavailable {
        /// Why, in words a user can act on ("libnccl.so.2 not found: install
        /// the NCCL runtime or set ACCEL_NCCL_LIB").
        reason: String,
    },
}

/// The outcome of [`Backend::probe`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Probe {
    /// Available, or unavailable with the reason.
    pub availability: Availability,
    /// Devices of the backend's kind visible to this process (1 for CPU
    /// engines).
    pub device_count: usize,
    /// Version of the engine library, when it can be read.
    pub engine_version: Option<String>,
}

impl Probe {
    /// An available backend.
    pub fn available(device_count: usize, engine_version: Option<String>) -> Probe {
        Probe {
            availability: Availability::Available,
            device_count,
            engine_version,
        }
    }

    /// An unavailable backend, with the reason.
    pub fn unavailable(reason: impl Into<String>) -> Probe {
        Probe {
            availability: Availability::Unavailable {
                reason: reason.into(),
            },
            device_count: 0,
            engine_version: None,
        }
    }

    /// `true` when available.
    pub fn is_available(&self) -> bool {
        matches!(self.availability, Availability::Available)
    }

    /// The reason, when unavailable.
    pub fn reason(&self) -> Option<&str> {
        match &self.availability {
            Availability::Available => None,
            Availability::Unavailable { reason } => Some(reason),
        }
    }
}

/// What a probe may look at besides the machine: the shape of the run.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProbeContext {
    /// Number of processes in the run.
    pub world_size: usize,
    /// Number of processes on this machine.
    pub local_world_size: usize,
    /// `true` when an MPI launcher (mpirun, mpiexec, srun with PMI) started
    /// the process.
    pub mpi_launched: bool,
    /// How many of the run's ranks this process hosts (as threads: the
    /// threads process model, or `accel::Threads`); 1 when each rank is a
    /// process. Absent in older serialized contexts: 1.
    #[serde(default = "one")]
    pub ranks_in_process: usize,
}

fn one() -> usize {
    1
}

impl ProbeContext {
    /// A one-process run.
    pub fn single_process() -> ProbeContext {
        ProbeContext {
            world_size: 1,
            local_world_size: 1,
            mpi_launched: false,
            ranks_in_process: 1,
        }
    }
}

/// Everything [`Backend::connect`] needs to build a communicator.
#[derive(Clone)]
pub struct ConnectContext {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank among the processes on this machine.
    pub local_rank: usize,
    /// Number of processes on this machine.
    pub local_world_size: usize,
    /// The device this rank drives.
    pub device: Device,
    /// The bound for every blocking call, inherited by sub-groups.
    pub timeout: Duration,
    /// The rendezvous store, already scoped to this run (and to this
    /// communicator: backends may use any key under it).
    pub store: Arc<dyn Store>,
    /// Identifier shared by all ranks of the run.
    pub run_id: String,
}

impl fmt::Debug for ConnectContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectContext")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("local_world_size", &self.local_world_size)
            .field("device", &self.device)
            .field("timeout", &self.timeout)
            .field("run_id", &self.run_id)
            .finish_non_exhaustive()
    }
}

impl ConnectContext {
    /// The context of rank `rank` of `world_size` processes that all run on
    /// this machine, on the CPU, with run id `local`: what tests, tools and
    /// in-process runs (ranks as threads) connect with. Adjust with the
    /// `with_*` builders.
    pub fn local(
        rank: usize,
        world_size: usize,
        timeout: Duration,
        store: Arc<dyn Store>,
    ) -> ConnectContext {
        ConnectContext {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            device: Device::CPU,
            timeout,
            store,
            run_id: "local".into(),
        }
    }

    /// Builder: the device this rank drives.
    pub fn with_device(mut self, device: Device) -> ConnectContext {
        self.device = device;
        self
    }

    /// Builder: the run id.
    pub fn with_run_id(mut self, run_id: impl Into<String>) -> ConnectContext {
        self.run_id = run_id.into();
        self
    }

    /// Check the context before connecting `backend`, whose engine drives
    /// devices of `kind`: the rank is in the world, and the device is of
    /// that kind.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](crate::ErrorKind::InvalidConfig) naming
    /// what is wrong and how to fix it, tagged with the backend, the rank and
    /// the `connect` operation.
    pub fn check(&self, backend: &str, kind: DeviceKind) -> Result<()> {
        let fail = |msg: String, fix: &str| {
            Err(crate::Error::new(crate::ErrorKind::InvalidConfig, msg)
                .with_op("connect")
                .with_backend(backend)
                .with_rank(self.rank)
                .with_fix(fix))
        };
        if self.world_size == 0 || self.rank >= self.world_size {
            return fail(
                format!(
                    "rank {} is not in a world of {} ranks",
                    self.rank, self.world_size
                ),
                "set RANK below WORLD_SIZE",
            );
        }
        if self.device.kind != kind {
            return fail(
                format!("{backend} drives {kind} devices, not {}", self.device),
                "pick a backend for that device, or a device of this backend's kind",
            );
        }
        Ok(())
    }
}

/// A registration record for one collective engine.
///
/// In-tree backends submit a [`BackendRegistration`] with `inventory` and
/// also expose a `register()` function; out-of-tree backends implement this
/// trait in a cdylib and export it with `accel_plugin::export_plugin!`.
pub trait Backend: Send + Sync + 'static {
    /// Unique lower-case name (`cpu-gloo`); what `ACCEL_BACKEND` selects.
    fn name(&self) -> &str;

    /// Probe order: higher first. Use the `PRIORITY_*` constants.
    fn priority(&self) -> i32;

    /// The kind of device this backend drives.
    fn device_kind(&self) -> DeviceKind;

    /// Can this backend run here, for a run shaped like `ctx`?
    ///
    /// Must be cheap (no network, no device initialisation beyond counting),
    /// must never panic, and must return a reason a user can act on when the
    /// answer is no.
    fn probe(&self, ctx: &ProbeContext) -> Probe;

    /// Build the world communicator for this rank.
    ///
    /// Collective over all ranks of the run: every rank calls it with the
    /// same `world_size`, `run_id` and store. Blocks at most `ctx.timeout`.
    ///
    /// # Errors
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable) when the
    /// probe would say so; [`ErrorKind::Timeout`](crate::ErrorKind::Timeout)
    /// when peers did not show up in time, naming the missing ranks where
    /// possible; [`ErrorKind::InvalidConfig`](crate::ErrorKind::InvalidConfig)
    /// when the context contradicts the engine's view (MPI sizes).
    fn connect(&self, ctx: ConnectContext) -> Result<Box<dyn Communicator>>;
}

/// A backend that is its registration record: a name, a priority, a device
/// kind and two functions. In-tree backends are `const` values of this type
/// (`pub const BACKEND: StaticBackend = StaticBackend::new(...)`); the
/// record is the whole [`Backend`] implementation, so no backend writes the
/// trait's getters by hand. Plugins and wrappers that need state implement
/// [`Backend`] themselves.
#[derive(Clone, Copy)]
pub struct StaticBackend {
    name: &'static str,
    priority: i32,
    device_kind: DeviceKind,
    probe: fn(&ProbeContext) -> Probe,
    connect: fn(ConnectContext) -> Result<Box<dyn Communicator>>,
}

impl StaticBackend {
    /// The record of a backend named `name` (what `ACCEL_BACKEND` selects),
    /// probed in `priority` order, driving `device_kind` devices, whose
    /// [`Backend::probe`] and [`Backend::connect`] are `probe` and `connect`
    /// (with the requirements those methods document).
    pub const fn new(
        name: &'static str,
        priority: i32,
        device_kind: DeviceKind,
        probe: fn(&ProbeContext) -> Probe,
        connect: fn(ConnectContext) -> Result<Box<dyn Communicator>>,
    ) -> StaticBackend {
        StaticBackend {
            name,
            priority,
            device_kind,
            probe,
            connect,
        }
    }
}

impl fmt::Debug for StaticBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StaticBackend")
            .field("name", &self.name)
            .field("priority", &self.priority)
            .field("device_kind", &self.device_kind)
            .finish_non_exhaustive()
    }
}

impl Backend for StaticBackend {
    fn name(&self) -> &str {
        self.name
    }

    fn priority(&self) -> i32 {
        self.priority
    }

    fn device_kind(&self) -> DeviceKind {
        self.device_kind
    }

    fn probe(&self, ctx: &ProbeContext) -> Probe {
        (self.probe)(ctx)
    }

    fn connect(&self, ctx: ConnectContext) -> Result<Box<dyn Communicator>> {
        (self.connect)(ctx)
    }
}

/// The `inventory` record in-tree backends submit.
///
/// ```ignore
/// accel_api::kit::submit_backend!(MyBackend::default);
/// ```
#[derive(Debug)]
pub struct BackendRegistration {
    /// Builds the backend. Must be cheap and must not panic.
    pub make: fn() -> Box<dyn Backend>,
    /// The crate that submitted it (for diagnostics).
    pub crate_name: &'static str,
}

inventory::collect!(BackendRegistration);

/// Submit an in-tree backend to the `inventory` registry:
/// `accel_api::kit::submit_backend!(|| Box::new(MyBackend))` (a kit item:
/// its path at the crate root is hidden).
#[doc(hidden)]
#[macro_export]
macro_rules! submit_backend {
    ($make:expr) => {
        $crate::__private::inventory::submit! {
            $crate::kit::BackendRegistration {
                make: $make,
                crate_name: ::core::env!("CARGO_PKG_NAME"),
            }
        }
    };
}

impl fmt::Debug for dyn Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("name", &self.name())
            .field("priority", &self.priority())
            .field("device_kind", &self.device_kind())
            .finish()
    }
}
