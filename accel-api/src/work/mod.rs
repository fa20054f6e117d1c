//! Work in flight: collectives and point-to-point calls started without
//! waiting (ADR 0033).
//!
//! [`Communicator::start`](crate::Communicator::start) takes a [`Call`] whose buffers it **owns** and
//! returns a [`Pending`] handle at once; [`StartExt`] gives the typed forms
//! (`start_all_reduce(buf, op) -> Work<B>`) that hand the buffers back from
//! [`Work::wait`]. Because the handle owns its buffers, the compiler forbids
//! touching them until the call completed, and soundness does not rest on
//! a destructor running: a handle that is leaked (`mem::forget`) leaves its
//! buffers with the engine, never a dangling write into memory the program
//! reused.
//!
//! # Behavior common to every handle
//!
//! * **Issue order.** Calls on one communicator run in the order they were
//!   issued (started or called blocking), as NCCL and MPI promise, whatever
//!   thread issued them. Every rank must issue the same collectives in the
//!   same order, as for blocking calls.
//! * **Errors at issue, errors at completion.** [`Communicator::start`](crate::Communicator::start)
//!   returns the errors it can see without communicating (capability,
//!   argument and poison checks) at once; what happens on the wire
//!   (timeouts, lost peers, a mismatched call found by the call check) is
//!   returned by [`Work::wait`], naming the rank, the operation with its
//!   sequence number (`all_reduce#12`) and the backend.
//! * **Bounded.** Once the engine has begun a call, it ends within the
//!   communicator's timeout (plus a grace for the engine to return);
//!   [`Work::wait`] gives up after that, aborts the communicator and returns
//!   [`ErrorKind::Timeout`](crate::ErrorKind::Timeout). [`Work::wait_timeout`] waits at most the given
//!   time and never fails.
//! * **Dropped handles wait.** Dropping an unfinished handle waits for it
//!   (bounded as above, then aborting the communicator); its error, if any,
//!   is logged and, when fatal, has poisoned the communicator, so the next
//!   call reports it.

mod call;
mod ext;
pub(crate) mod pending;

pub use call::{Call, CallInfo, CallMut, HostBytes, Owned, OwnedBuf, ENGINE_GRACE};
pub use ext::StartExt;
pub use pending::{Pending, Work, WorkLabel};
// The executor's side of a handle, `Completer`, is kit (`accel_api::kit`).
