//! # accel-api: the contracts every accel engine and runtime piece agrees on
//!
//! accel runs one training or inference program unchanged on one process or
//! many. It never implements a collective algorithm itself: each *backend*
//! drives an existing engine (Gloo, MPI, NCCL, PJRT, HCCL). This crate is the
//! contract between those backends and the runtime (`accel`), and it has no
//! engine dependency.
//!
//! ## The pieces
//!
//! | item | role |
//! |---|---|
//! | [`DType`], [`Element`] | the eight element types a collective can carry |
//! | [`ReduceOp`] | sum, prod, min, max, avg |
//! | [`Device`], [`DeviceKind`] | where a buffer lives |
//! | [`HostBuf`], [`HostBufMut`], [`DeviceBuf`], [`DeviceBufMut`], [`Buf`], [`BufMut`] | typed, object-safe buffer views; device views borrow their owner |
//! | [`Capabilities`], [`Op`] | what a communicator declares it can do, up front |
//! | [`Communicator`], [`CommunicatorExt`] | collectives over one process group |
//! | [`CallCheck`] | the call check: every collective's shape compared across ranks before the engine runs it (on by default; `ACCEL_CHECK_CALLS`) |
//! | [`Layer`], [`Layered`], [`CallInfo`] | forwarding layers (debug fingerprinting, vendor wrappers) |
//! | [`Backend`], [`Probe`], [`Availability`], [`ProbeContext`], [`ConnectContext`] | a backend as the registry shows it: name, priority, device kind, probe, connect |
//! | [`Store`], [`StoreExt`] | the rendezvous key-value store every engine bootstraps from |
//! | [`Wrapper`] | what `prepare()` returns |
//! | [`OffloadStore`] | named tensors for big-model offload |
//! | [`Error`], [`ErrorKind`] | the one public error type |
//! | [`files`] | opening files named by other files: regular files inside their folder only, reads bounded by size |
//! | [`durable::write_atomic`] | the one durable file write (temporary file, fsync, rename, directory fsync) |
//! | [`worker`] | the launcher-worker protocol: variable names, the error record |
//! | [`kit`] | **for engine authors only**: [`Engine`](kit::Engine), [`Group`](kit::Group), the poll loop, the mailbox, the point-to-point header, [`StaticBackend`](kit::StaticBackend) and the registration |
//!
//! ## Two faces
//!
//! The root holds the contracts a program uses; [`kit`] holds what only a
//! backend author needs, reached only as `accel_api::kit::Xxx` (OpenDAL's
//! `raw`; docs/adr/0034-user-face-and-kit.md). `files` and `durable` are
//! utilities accel's own crates share; the `accel` facade re-exports the
//! contracts by name, [`worker`], and the kit as `accel::kit`.
//!
//! ## Rules every backend follows
//!
//! 1. **Declare, then act.** [`Communicator::capabilities`] lists every
//!    operation, element type and reduction the communicator accepts. Calling
//!    anything outside that set returns [`ErrorKind::Unsupported`]; it never
//!    panics and never computes a wrong answer.
//! 2. **Every blocking call ends.** A communicator is built with a timeout
//!    ([`ConnectContext::timeout`]); every collective, point-to-point call and
//!    barrier returns [`ErrorKind::Timeout`] or [`ErrorKind::PeerLost`] once it
//!    is exceeded or a peer disappears. Sub-groups inherit the timeout.
//! 3. **Failures poison.** After a timeout, a lost peer or an abort, the
//!    communicator returns [`ErrorKind::Poisoned`] (naming the first failure)
//!    on every later call instead of hanging on a half-finished protocol.
//! 4. **Errors say who, what, where and how to fix it.** Build them with
//!    [`Error::new`] and add the rank, the operation and the backend name.
//! 5. **Collective calling convention.** Every rank of the group calls the
//!    same operations in the same order with the same element type, element
//!    count and root. Breaking it is a user error that the call check
//!    ([`CallCheck`], on by default) reports as [`ErrorKind::Mismatch`] on every
//!    rank before the engine runs the call; debug mode adds a per-rank table
//!    through the store.
//!
//! A backend implements rules 1-5 by implementing [`kit::Engine`] and
//! handing it to [`kit::Group::new`]: the group does the checks, the
//! poisoning and the error context once for every engine.
//!
//! Plugins loaded with `dlopen` implement these same traits; the C boundary
//! that carries them lives in the `accel-plugin` crate so that this crate can
//! stay free of `unsafe` code. The one exception is a declaration, not a use:
//! the device-view constructors [`DeviceBuf::from_raw`] and
//! [`DeviceBufMut::from_raw`] are `unsafe fn` (the caller vouches for the
//! address) and only store their arguments; no `unsafe` block exists in this
//! crate (docs/adr/0007-device-views-unsafe-constructor.md).
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[macro_use]
mod codes;

mod backend;
mod buffer;
mod caps;
mod check;
mod comm;
mod device;
mod dtype;
pub mod durable;
mod error;
pub mod files;
mod group;
pub mod kit;
mod layer;
mod offload;
mod op;
mod store;
pub mod sync;
pub mod work;
pub mod worker;
mod wrapper;

// The user contracts. The engine kit (the group folder, the call check's
// machinery, the static registration, `validate`) is `kit`, never here.
pub use backend::{Availability, Backend, ConnectContext, Probe, ProbeContext};
pub use buffer::{Buf, BufMut, DeviceBuf, DeviceBufMut, HostBuf, HostBufMut};
pub use caps::{Capabilities, Op};
pub use check::CallCheck;
pub use comm::{Communicator, CommunicatorExt};
pub use device::{Device, DeviceKind};
pub use dtype::{DType, Element, Half16};
pub use error::{Error, ErrorKind, MismatchEntry, Result};
pub use layer::{Layer, Layered};
pub use offload::{OffloadStore, TensorMeta};
pub use op::ReduceOp;
pub use store::{CasOutcome, Store, StoreExt};
pub use work::CallInfo;
pub use work::{HostBytes, OwnedBuf, Pending, StartExt, Work};
pub use wrapper::Wrapper;

/// The flight recorder: every communicator's ring of its last calls, read
/// by dumps when something goes wrong (`ACCEL_FLIGHT_RECORDER=N`, 0 off).
pub mod flight {
    pub use crate::group::{
        flight_recorders, ring_size_from_env, CallRecord, CallState, FlightRecorder, GroupIdentity,
        DEFAULT_RING, FLIGHT_RECORDER_ENV,
    };
}

/// Re-exported so that backends and vendors name the same `half` types.
pub use half::{bf16, f16};

#[doc(hidden)]
pub mod __private {
    pub use inventory;
}

#[cfg(test)]
mod unsafe_policy {
    /// The crate declares two `unsafe fn` constructors and nothing else
    /// unsafe: no `unsafe` block, impl or trait (ADR 0007).
    #[test]
    fn no_unsafe_block_impl_or_trait() {
        let mut dirs = vec![std::path::PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/src"
        ))];
        let mut declared = 0;
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                for (i, line) in text.lines().enumerate() {
                    let code = line.split("//").next().unwrap_or("");
                    // Spelled in pieces so that this test does not find itself.
                    for bad in ["{", "impl", "trait", "extern"].map(|w| format!("{} {w}", "unsafe"))
                    {
                        assert!(
                            !code.contains(&bad),
                            "{}:{}: `{bad}` in accel-api",
                            path.display(),
                            i + 1
                        );
                    }
                    if code.contains(&format!("pub {} fn from_raw", "unsafe")) {
                        declared += 1;
                    }
                }
            }
        }
        assert_eq!(declared, 2, "exactly the two device-view constructors");
    }
}
