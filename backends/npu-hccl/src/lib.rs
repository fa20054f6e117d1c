//! # accel-backend-npu-hccl: accel on Huawei Ascend NPUs
//!
//! The `npu-hccl` backend drives [HCCL] (Huawei Collective Communication
//! Library) and AscendCL, the runtime of Ascend NPUs, both part of the CANN
//! toolkit. Nothing is needed at build time: `libascendcl.so` and
//! `libhccl.so` are opened at run time with `libloading`, so the crate
//! builds and probes everywhere, and is *available* only where CANN and an
//! NPU are.
//!
//! ## Finding the libraries
//!
//! `ACCEL_ASCEND_LIB_DIR` alone when set; otherwise, in order,
//! `$ASCEND_TOOLKIT_HOME/lib64`, `$ASCEND_HOME_PATH/lib64` (both set by
//! CANN's `set_env.sh`), `/usr/local/Ascend/ascend-toolkit/latest/lib64`,
//! `/usr/local/Ascend/cann/lib64` (CANN >= 8.5), then the dynamic loader's
//! search (`LD_LIBRARY_PATH`). AscendCL is opened first with
//! `RTLD_GLOBAL` (HCCL binds runtime symbols against it), then HCCL. The
//! libraries are never unloaded.
//!
//! ## The probe
//!
//! Load both libraries, resolve every symbol the backend calls (a missing
//! one, e.g. `aclrtStreamQuery` on an old CANN, is named in the reason),
//! `aclInit(NULL)` once per process (`ACL_ERROR_REPEAT_INITIALIZE`, 100002,
//! counts as success: torch_npu may have initialised first), then
//! `aclrtGetDeviceCount`, cut to the length of `ASCEND_RT_VISIBLE_DEVICES`
//! when set (what `accelerate launch --gpu_ids` sets on NPU; a malformed
//! list is a reason naming the variable). Any failure is
//! `unavailable: <reason>`; nothing panics. A run with more ranks on one
//! machine than visible NPUs is unavailable too: HCCL wants one NPU per
//! rank.
//!
//! ## Connecting
//!
//! Rank `r` drives NPU `device.index` (the facade binds local rank →
//! device). Rank 0 calls `HcclGetRootInfo` and publishes the 4,108 bytes
//! under `npu-hccl/<n>/root` in the run's [`Store`](accel_api::Store) (`n`
//! counts this rank's connects); every rank then calls
//! `HcclCommInitRootInfo` on a helper thread, so that the wait ends at the
//! accel timeout even though HCCL's own bound has a 120 s floor. Each
//! communicator owns one AscendCL stream.
//!
//! Unless the user set them, `HCCL_CONNECT_TIMEOUT` and `HCCL_EXEC_TIMEOUT`
//! are derived from the accel timeout of the first connect of the process
//! (`hccl_timeouts`): at least the accel timeout, within HCCL's ranges,
//! so that accel's own deadline fires first. `HCCL_IF_IP` and
//! `HCCL_SOCKET_IFNAME` are HCCL's and left alone.
//!
//! ## Calls
//!
//! | operation | element types | how |
//! |---|---|---|
//! | all_reduce, reduce | f16, bf16, f32, i8, i32 | `HcclAllReduce` / `HcclReduce` in place; sum, prod, min, max; `avg` = sum, then divide (host buffers by the group; device buffers by [`Engine::divide_device`](accel_api::kit::Engine::divide_device): a copy to the host, the same division, a copy back) |
//! | reduce_scatter | same | `HcclReduceScatter` |
//! | broadcast, all_gather, scatter, all_to_all | all eight | `HcclBroadcast`, `HcclAllGather`, `HcclScatter`, `HcclAlltoAll` on the bytes (`HCCL_DATA_TYPE_INT8`, exact for every type) |
//! | gather | all eight | HCCL has none: `HcclAllGather` into scratch memory, the root keeps it |
//! | send, recv | all eight | `HcclSend`/`HcclRecv` of a 16-byte header (length, dtype, tag) then the payload: a receive of the wrong size or type is an `InvalidArgument` error with nothing written; a message with another tag is kept for its own receive; device memory sent to self is kept for the receive from self |
//! | barrier | - | `HcclBarrier` |
//! | split | - | `(color, key)` exchanged through the store, then a new communicator per color over its first member's root info |
//!
//! f64, i64 and u8 reductions are not declared: HCCL does not reduce them
//! on every Ascend generation. Host buffers are staged through device
//! memory (`aclrtMalloc`, `aclrtMemcpy`) per call; device buffers
//! ([`NpuBuffer`] or a framework's view) are used in place, after their
//! own stream (the view's `stream()`) has no pending work.
//!
//! ## Timeouts and failures
//!
//! Every call enqueues on the communicator's stream and then polls
//! `HcclGetCommAsyncError` and `aclrtStreamQuery` until the accel timeout:
//! a stream still busy is [`ErrorKind::Timeout`], an asynchronous
//! `HCCL_E_TIMEOUT` too, a broken link (`HCCL_E_TCP_*`, `HCCL_E_ROCE_*`,
//! `HCCL_E_NETWORK`, `HCCL_E_REMOTE`) is [`ErrorKind::PeerLost`], any other
//! code [`ErrorKind::Backend`] naming the call and HCCL's text. The group
//! then poisons the communicator. After such a failure the communicator,
//! its stream and its staging memory are deliberately leaked, not
//! destroyed: the device may still be working on them, and destroying
//! them could hang. `abort` poisons but cannot interrupt a running HCCL
//! call (`abort_interrupts` is `false`).
//!
//! ## What is tested where
//!
//! The crate's tests run against a stub `libascendcl.so` / `libhccl.so`
//! built by the tests from `tests/stub/*.c` (a one-rank "HCCL" that copies
//! on host memory posing as device memory). They cover the probe's failure
//! paths and the glue (argument and error handling, staging, headers,
//! timeouts, poisoning); **they say nothing about real HCCL**. On Ascend
//! hardware, run `accel env` and `accel test --backend npu-hccl -n N`
//! (docs/backends.md).
//!
//! [HCCL]: https://www.hiascend.com/document
//! [`ErrorKind::Timeout`]: accel_api::ErrorKind::Timeout
//! [`ErrorKind::PeerLost`]: accel_api::ErrorKind::PeerLost
//! [`ErrorKind::Backend`]: accel_api::ErrorKind::Backend
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod engine;
mod error;
#[allow(unsafe_code)] // the C boundary: every call into AscendCL and HCCL, nothing else
mod ffi;
mod name;
mod probe;

use std::path::{Path, PathBuf};

use accel_api::kit::{Group, PRIORITY_NPU};
use accel_api::{
    Backend, Communicator, ConnectContext, DeviceKind, Error, Probe, ProbeContext, Result,
};

// The crate's face (ADR 0034): the record, the name, the backend type
// (for a fixed CANN folder) and what a program uses for device memory: the
// concrete communicator, its engine's `alloc`/`upload`/`download` and the
// buffer they make. Its own tests reach the rest through `__test`.
pub use engine::{NpuCommunicator, NpuEngine};
pub use ffi::NpuBuffer;
pub use name::NAME;

use error::HcclError;
use probe::Search;

/// The `npu-hccl` backend's registration record, finding CANN through the
/// environment ([`NpuHcclBackend::with_lib_dir`] for a fixed folder).
pub const BACKEND: NpuHcclBackend = NpuHcclBackend::new();

/// The `npu-hccl` backend.
#[derive(Debug, Default, Clone)]
pub struct NpuHcclBackend {
    /// `None`: search as the crate docs say; `Some(dir)`: only `dir`.
    lib_dir: Option<PathBuf>,
}

impl NpuHcclBackend {
    /// The backend, finding CANN through the environment.
    pub const fn new() -> NpuHcclBackend {
        NpuHcclBackend { lib_dir: None }
    }

    /// The backend loading `libascendcl.so` and `libhccl.so` from `dir`
    /// only (no other folder, no loader search).
    pub fn with_lib_dir(dir: impl AsRef<Path>) -> NpuHcclBackend {
        NpuHcclBackend {
            lib_dir: Some(dir.as_ref().to_path_buf()),
        }
    }

    fn search(&self) -> Search {
        match &self.lib_dir {
            Some(d) => Search::only(d),
            None => Search::from_env(&|k| std::env::var(k).ok()),
        }
    }

    /// Connect the world communicator of this rank (what
    /// [`Backend::connect`] does, with the concrete type).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig)
    /// for a rank outside the world or a device that is not a visible NPU;
    /// [`ErrorKind::Unavailable`](accel_api::ErrorKind::Unavailable) when
    /// the probe would say so; [`ErrorKind::Timeout`](accel_api::ErrorKind::Timeout)
    /// when rank 0's root info or the other ranks did not arrive in time.
    pub fn connect_npu(&self, ctx: ConnectContext) -> Result<NpuCommunicator> {
        let rank = ctx.rank;
        let context = |e: Error| e.with_backend(NAME).with_rank(rank).with_op("connect");
        self.connect_inner(ctx).map_err(context)
    }

    fn connect_inner(&self, ctx: ConnectContext) -> Result<NpuCommunicator> {
        ctx.check(NAME, DeviceKind::Npu)?;
        let search = self.search();
        let rt = probe::runtime(&search)?;
        let (count, _) = probe::devices(&search, &|k| std::env::var(k).ok()).map_err(|reason| {
            Error::new(accel_api::ErrorKind::Unavailable, reason)
                .with_fix("check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES")
        })?;
        if ctx.device.index as usize >= count {
            return Err(HcclError::Config {
                detail: format!("{} is not one of the {count} visible NPUs", ctx.device),
                fix: "run at most one rank per visible NPU on each machine".into(),
            }
            .into());
        }
        engine::apply_hccl_env(ctx.timeout);
        let generation = ctx
            .store
            .add(&format!("npu-hccl/connects/{}", ctx.rank), 1)?;
        let engine = NpuEngine::connect(engine::Params {
            rt,
            store: ctx.store.clone(),
            prefix: format!("npu-hccl/{generation}"),
            rank: ctx.rank,
            world: ctx.world_size,
            device: ctx.device,
            timeout: ctx.timeout,
        })?;
        Ok(Group::new(engine))
    }
}

impl Backend for NpuHcclBackend {
    fn name(&self) -> &str {
        NAME
    }

    fn priority(&self) -> i32 {
        PRIORITY_NPU
    }

    fn device_kind(&self) -> DeviceKind {
        DeviceKind::Npu
    }

    fn probe(&self, ctx: &ProbeContext) -> Probe {
        probe::probe(&self.search(), ctx, &|k| std::env::var(k).ok())
    }

    fn connect(&self, ctx: ConnectContext) -> Result<Box<dyn Communicator>> {
        self.connect_npu(ctx)
            .map(|c| Box::new(c) as Box<dyn Communicator>)
    }
}

accel_api::kit::submit_backend!(|| Box::new(BACKEND));

/// Not API: what this crate's own tests reach beyond its face.
#[doc(hidden)]
pub mod __test {
    pub use crate::engine::{capabilities, hccl_timeouts};
    pub use crate::probe::{ACL_LIBRARY, HCCL_LIBRARY};

    /// The AscendCL and HCCL symbols the backend resolves (all must exist).
    pub fn required_symbols() -> (&'static [&'static str], &'static [&'static str]) {
        (crate::ffi::acl_symbols(), crate::ffi::hccl_symbols())
    }
}
