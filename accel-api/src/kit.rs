//! The engine kit: what backend and plugin authors build with.
//!
//! ## Notes
//!
//! - Only authors of a backend (an in-tree engine crate, a dlopen plugin,
//!   a wrapper that registers its own backend) need this module. Programs
//!   use the crate root (the contracts: [`Communicator`](crate::Communicator),
//!   [`Store`](crate::Store), buffer views, [`Error`](crate::Error), ...) or
//!   the `accel` facade, which re-exports this module as `accel::kit` and
//!   never at its root.
//! - Kit items are reached only as `accel_api::kit::Xxx` (or
//!   `accel::kit::Xxx`); no user-facing signature names one. The shape is
//!   OpenDAL's `raw` module (docs/adr/0034-user-face-and-kit.md).
//! - The kit changes with the engines' needs more freely than the
//!   contracts do.
//!
//! ## What is here
//!
//! | item | role |
//! |---|---|
//! | [`Engine`], [`EngineInfo`] | the calls into one engine, on arguments already checked, and its identity stated once |
//! | [`Group`] | any engine as a [`Communicator`](crate::Communicator): checks, the call check, poisoning, self-sends, `Avg`, error context, once for every engine |
//! | [`SplitPlan`] | the colours and keys of a `split`, agreed through the engine |
//! | [`host`], [`host_mut`], [`message_does_not_fit`] | host views of a checked buffer; the error of a receive too small |
//! | [`Deadline`], [`Backoff`], [`Poller`], [`Growth`], [`Clock`], [`SystemClock`], [`Expired`], [`Pause`], [`Polled`], [`Until`] | the one poll loop against the timeout, with each engine's pause schedule |
//! | [`timeout_error`], [`TIMEOUT_FIX`] | the one timeout error every engine returns |
//! | [`Mailbox`], [`Taken`] | messages kept for a later receive (sends to self, another tag first) |
//! | [`P2pHeader`], [`P2P_MAGIC`] | the header every engine sends before a point-to-point payload |
//! | [`validate`] | the argument checks every communicator shares |
//! | [`Completer`], [`on_group_worker`] | the executor's side of a started call; whether the engine runs on a group's worker thread (it may then wait without spinning) |
//! | [`StaticBackend`], [`BackendRegistration`], [`submit_backend!`](crate::kit::submit_backend), `PRIORITY_*` | a backend's registration record, its `inventory` submission and the probe order |
//!
//! What a backend crate exports: its record (`pub const BACKEND:
//! StaticBackend`) and the items a program may call directly, each with a
//! doc comment saying why; its engine, communicator type and probe stay
//! private (tests reach them through a `#[doc(hidden)] pub mod __test`,
//! which is not API). docs/backends-guide.md walks through writing one.
//!
//! ## The call check
//!
//! Before every collective the ranks of a [`Group`] compare the call's
//! operation, element type, length, root and reduction with one tiny
//! all-gather through the engine (ADR 0016), so that a mismatched call is
//! an [`ErrorKind::Mismatch`](crate::ErrorKind::Mismatch) error on every
//! rank and never reaches the engine. An engine sees the check's own
//! `all_gather` (9 elements per rank) before each collective; see
//! [`Engine`] for what it may assume. Users set the check with
//! [`CallCheck`](crate::CallCheck) (`ACCEL_CHECK_CALLS`), at the root.

pub use crate::backend::{
    BackendRegistration, StaticBackend, PRIORITY_CPU, PRIORITY_CUDA, PRIORITY_FALLBACK,
    PRIORITY_MPI, PRIORITY_NPU, PRIORITY_XLA,
};
pub use crate::comm::validate;
pub use crate::group::{
    host, host_mut, message_does_not_fit, on_group_worker, timeout_error, Backoff, Clock, Deadline,
    Engine, EngineInfo, Expired, Group, Growth, Mailbox, P2pHeader, Pause, Polled, Poller,
    SplitPlan, SystemClock, Taken, Until, P2P_MAGIC, TIMEOUT_FIX,
};
/// Submit an in-tree backend to the `inventory` registry (see
/// [`BackendRegistration`]).
pub use crate::submit_backend;
pub use crate::work::pending::Completer;
