//! # accel-backend-cpu-gloo: accel on the real Gloo library
//!
//! The `cpu-gloo` backend drives [Gloo] (Debian's `libgloo-dev`, a 2022
//! snapshot, Gloo 0.5.0) through a small C++ shim (`shim/gloo_shim.cc`)
//! compiled by `build.rs`. Collectives run over Gloo's TCP transport between
//! processes (or threads) on host memory.
//!
//! ## Building
//!
//! `build.rs` looks for `gloo/context.h` in `/usr/include` and `libgloo.so`
//! in `/usr/lib` (or the folders named by `ACCEL_GLOO_INCLUDE_DIR` and
//! `ACCEL_GLOO_LIB_DIR`); without them it stops with one line:
//! `accel-backend-cpu-gloo needs Gloo: run 'apt-get install libgloo-dev'`.
//!
//! ## The boundary
//!
//! * The shim exposes plain `extern "C"` functions; each catches every C++
//!   exception (`gloo::IoException`, `gloo::Exception`,
//!   `gloo::EnforceNotMet`, `std::exception`, anything else) into a status
//!   code and a message. No exception reaches Rust and no panic reaches C++.
//! * All `unsafe` Rust is in the private `ffi` module: handle newtypes whose
//!   `Drop` frees the Gloo object, one `// SAFETY:` note per block.
//! * Shim failures become the private `GlooError`, turned into
//!   [`accel_api::Error`] at each method's boundary, naming rank, op and
//!   backend.
//!
//! ## Rendezvous and addresses
//!
//! Gloo's `rendezvous::Store` is implemented in the shim by callbacks into
//! the [`accel_api::Store`] of [`ConnectContext::store`], under a key prefix
//! unique to each communicator: `cpu-gloo/<n>` for the world group, where
//! `n` counts this rank's connects on that store, and
//! `<parent>/split<k>/color<c>` for the `k`-th split of a group. The whole
//! connection honours [`ConnectContext::timeout`]; a rank that never joins
//! makes the others fail with [`ErrorKind::Timeout`] naming it.
//!
//! Gloo listens on (first match wins): `ACCEL_GLOO_HOSTNAME` (host name or
//! IP), `ACCEL_GLOO_IFNAME` (interface), `GLOO_SOCKET_IFNAME` (PyTorch's
//! variable, first of a comma-separated list), then an address derived
//! from the store: `127.0.0.1` for an in-process store or a store on
//! loopback, otherwise this machine's address on the route to the store's
//! host (the first member's, for a cluster such as etcd's);
//! failing all that, Gloo's default (this machine's host name).
//!
//! ## What is supported
//!
//! | operation | element types | how |
//! |---|---|---|
//! | all_reduce, reduce | f16, f32, f64, i8, u8, i32, i64 | Gloo's ring all-reduce / reduce with Gloo's `sum`, `product`, `min`, `max`; `avg` = sum, then divide by the group size on the host (integers truncate toward zero) |
//! | reduce_scatter | same | the shim's ring on Gloo's unbound buffers, straight into the output (see below) |
//! | broadcast, all_gather, gather, scatter, all_to_all | all eight, bf16 included | Gloo's collectives on raw bytes (exact for every type); all_gathers of up to 240 bytes per rank (the call check's, a split's) go instead over a second mesh in Gloo's synchronous mode, one frame per peer read by the calling thread (the shim's `SmallMesh`: about 10 µs instead of Gloo's ~100 µs on loopback), where ranks passing different byte counts get an `InvalidArgument` error instead of Gloo's abort |
//! | send, recv | all eight | Gloo unbound buffers; a 16-byte header (length, dtype) precedes each payload, so a receive of the wrong size is an `InvalidArgument` error instead of a Gloo assertion that aborts the process; sends to self go through an in-process mailbox (Gloo has no connection to self) |
//! | barrier | - | Gloo's barrier |
//! | split | - | `(color, key)` all-gathered, then a new Gloo context per color sharing the TCP device |
//!
//! bf16 reductions are not declared: Gloo has no bfloat16 type. f16 uses
//! `gloo::float16`, whose arithmetic goes through `float` and rounds once to
//! half (correctly rounded for +, *). Integer sums and products wrap (the
//! shim's kernels compute them in the unsigned type of the same width). Zero-element buffers are accepted; the
//! call returns at once on every rank (they all agree it is empty), except
//! send/recv which still exchange their header.
//!
//! **reduce_scatter**: Gloo's `ReduceScatterHalvingDoubling` is an old-style
//! algorithm that reduces in place into its input, leaves the result at the
//! start of the buffer, and waits on bound buffers without the per-op
//! timeout. The shim runs its own ring instead (`size - 1` steps on Gloo's
//! unbound buffers, one deadline for the whole call): each rank sends
//! `(size - 1) / size` of the input, half an all-reduce's traffic, and reads
//! the input without writing it. Each element is reduced on one rank, in
//! ring order, so a float sum can differ in its last bits from the same
//! element of an all-reduce (never between ranks).
//!
//! ## Failures
//!
//! Every call passes [`Communicator::timeout`] to Gloo (and the context has
//! it as its default). A Gloo I/O error whose message names a peer address
//! becomes [`ErrorKind::PeerLost`] with that peer's rank; a timeout becomes
//! [`ErrorKind::Timeout`]. To match addresses to ranks, each rank publishes
//! under `<prefix>/addr/<rank>`, right after connecting, the names the
//! other ranks' Gloo may print for their connection to it (its socket's
//! local address, and the listening address it advertised, which Gloo
//! prints when the peer accepted before its own connect call). After such a failure the communicator is
//! poisoned ([`ErrorKind::Poisoned`] naming the first failure, without
//! touching Gloo again), writes why under `<prefix>/fault/<rank>` in the
//! store and closes its connections so that the other ranks fail at once.
//! A rank that sees a peer close after such a failure reports the peer that
//! peer lost, when it published one: the root cause, not the messenger.
//!
//! A peer that dies (killed, crashed) closes its sockets; every survivor
//! with a call in flight gets `PeerLost` naming it within about half a
//! second (the wait for a published cause), whatever it was doing. Gloo
//! itself leaves a send whose bytes were queued on the failed connection
//! (and a receive whose payload was being read) waiting for its timeout:
//! the shim's unbound buffers (`GuardedBuffer`) wait in 50 ms slices and
//! check between them whether a connection they use has failed.
//!
//! Calls are serialised by a mutex: the communicator is `Send + Sync`, but
//! two threads calling it at once take turns. [`Communicator::abort`]
//! poisons, publishes why and closes the connections when no call is
//! running (the peers' `PeerLost` then names this rank and its reason); it
//! cannot interrupt a running Gloo collective (`abort_interrupts` is
//! `false`).
//!
//! Mismatched collective calls (different element counts on different
//! ranks) break Gloo's calling convention; Gloo may then fail an assertion
//! on its event-loop thread, which aborts the process. The runtime's debug
//! mode detects such mismatches before they reach the engine.
//!
//! [Gloo]: https://github.com/facebookincubator/gloo
//! [`ConnectContext::store`]: accel_api::ConnectContext::store
//! [`ConnectContext::timeout`]: accel_api::ConnectContext::timeout
//! [`ErrorKind::Timeout`]: accel_api::ErrorKind::Timeout
//! [`ErrorKind::PeerLost`]: accel_api::ErrorKind::PeerLost
//! [`ErrorKind::Poisoned`]: accel_api::ErrorKind::Poisoned
//! [`Communicator::timeout`]: accel_api::Communicator::timeout
//! [`Communicator::abort`]: accel_api::Communicator::abort
#![warn(missing_docs)]
#![deny(unsafe_code)]

mod engine;
mod error;
// Every FFI call into the Gloo shim lives here, behind handle newtypes.
#[allow(unsafe_code)]
mod ffi;
mod name;
mod probe;
mod rendezvous;

use std::sync::Arc;

use accel_api::kit::{StaticBackend, PRIORITY_CPU};
use accel_api::{ConnectContext, DeviceKind, Error, ErrorKind, Result};

// The crate's face is its record and its name (ADR 0034): programs and
// plugins reach the engine through `BACKEND` (a plugin that reuses it calls
// `BACKEND.probe` and `BACKEND.connect`). Its own tests reach the rest
// through `__test`.
pub use name::NAME;

use engine::{GlooCommunicator, GlooEngine, Params};

/// The `cpu-gloo` backend.
pub const BACKEND: StaticBackend =
    StaticBackend::new(NAME, PRIORITY_CPU, DeviceKind::Cpu, probe::probe, |ctx| {
        Ok(Box::new(connect(ctx)?))
    });

/// Connect the world communicator of this rank (what [`BACKEND`] does,
/// with the concrete type).
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] for a rank outside the world or a non-CPU
/// device; [`ErrorKind::Unavailable`] when Gloo cannot listen on the chosen
/// address; [`ErrorKind::Timeout`] naming the ranks that did not join.
fn connect(ctx: ConnectContext) -> Result<GlooCommunicator> {
    ctx.check(NAME, DeviceKind::Cpu)?;
    let fail = |kind: ErrorKind, msg: String| {
        Error::new(kind, msg)
            .with_op("connect")
            .with_backend(NAME)
            .with_rank(ctx.rank)
    };
    let bind = rendezvous::choose_bind(&ctx.store.describe(), &|k| std::env::var(k).ok());
    let gloo_device = ffi::Device::new(&bind.hostname, &bind.iface).map_err(|e| {
        let target = if bind.iface.is_empty() {
            format!("host `{}`", bind.hostname)
        } else {
            format!("interface `{}`", bind.iface)
        };
        fail(
            ErrorKind::Unavailable,
            format!(
                "Gloo cannot listen on {target} (chosen by {}): {e}",
                bind.source
            ),
        )
        .with_fix("set ACCEL_GLOO_HOSTNAME to an address of this machine or GLOO_SOCKET_IFNAME to an interface")
    })?;
    // A fresh prefix per connect on this store: Gloo's keys must not be
    // reused, and a process may connect more than once.
    let generation = ctx
        .store
        .add(&format!("cpu-gloo/connects/{}", ctx.rank), 1)
        .map_err(|e| e.with_op("connect").with_backend(NAME).with_rank(ctx.rank))?;
    GlooEngine::connect(Params {
        gloo_device: Arc::new(gloo_device),
        store: ctx.store.clone(),
        prefix: format!("cpu-gloo/{generation}"),
        info: accel_api::kit::EngineInfo::world(NAME, &ctx, engine::capabilities()),
    })
    .map(accel_api::kit::Group::new)
}

accel_api::kit::submit_backend!(|| Box::new(BACKEND));

/// Not API: what this crate's own tests and examples reach beyond the
/// record (the engine's concrete types and its version).
#[doc(hidden)]
pub mod __test {
    pub use crate::engine::{capabilities, GlooCommunicator};
    pub use crate::probe::{engine_version, PACKAGE_VERSION};

    /// The world communicator with its concrete type.
    pub fn connect(ctx: accel_api::ConnectContext) -> accel_api::Result<GlooCommunicator> {
        crate::connect(ctx)
    }
}
