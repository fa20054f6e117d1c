//! The crate's private error ([`NcclFailure`]) and its one conversion to
//! [`accel_api::Error`].
//!
//! NCCL and the driver report numeric codes; the ffi module turns them into
//! a [`NcclFailure`] with NCCL's own text (`ncclGetErrorString`,
//! `ncclGetLastError`: cudarc's `NcclError` prints only its name). The
//! engine adds what it knows (the operation, the device, how long it
//! waited) and converts here; the group then attaches the backend, rank and
//! operation.

use std::fmt;
use std::time::Duration;

use accel_api::kit::timeout_error;
use accel_api::{Error, ErrorKind};

/// An NCCL entry point, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NcclCall {
    GetUniqueId,
    CommInitRank,
    CommGetAsyncError,
    /// The asynchronous result of an earlier call (`ncclCommGetAsyncError`'s
    /// answer).
    Async,
    CommSplit,
    CommCount,
    CommFinalize,
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    ReduceScatter,
    Send,
    Recv,
    GroupStart,
    GroupEnd,
}

impl NcclCall {
    pub(crate) fn name(self) -> &'static str {
        match self {
            NcclCall::GetUniqueId => "ncclGetUniqueId",
            NcclCall::CommInitRank => "ncclCommInitRankConfig",
            NcclCall::CommGetAsyncError => "ncclCommGetAsyncError",
            NcclCall::Async => "the NCCL operation (ncclCommGetAsyncError)",
            NcclCall::CommSplit => "ncclCommSplit",
            NcclCall::CommCount => "ncclCommCount",
            NcclCall::CommFinalize => "ncclCommFinalize",
            NcclCall::AllReduce => "ncclAllReduce",
            NcclCall::Reduce => "ncclReduce",
            NcclCall::Broadcast => "ncclBroadcast",
            NcclCall::AllGather => "ncclAllGather",
            NcclCall::ReduceScatter => "ncclReduceScatter",
            NcclCall::Send => "ncclSend",
            NcclCall::Recv => "ncclRecv",
            NcclCall::GroupStart => "ncclGroupStart",
            NcclCall::GroupEnd => "ncclGroupEnd",
        }
    }
}

/// `ncclInvalidArgument`, `ncclInvalidUsage` (NCCL's numbering).
const NCCL_INVALID_ARGUMENT: u32 = 4;
const NCCL_INVALID_USAGE: u32 = 5;
/// `ncclRemoteError`: a peer failed or went away.
const NCCL_REMOTE_ERROR: u32 = 6;
/// `ncclSystemError`: often a socket to a peer that died.
const NCCL_SYSTEM_ERROR: u32 = 2;

/// What went wrong inside the backend.
#[derive(Debug, Clone)]
pub(crate) enum NcclFailure {
    /// An NCCL call returned an error code.
    Nccl {
        call: NcclCall,
        code: u32,
        /// `ncclGetErrorString`.
        text: String,
        /// `ncclGetLastError`: NCCL's detail, often naming the cause.
        last: String,
    },
    /// A CUDA driver call failed (`CUresult`, as its name).
    Driver { call: &'static str, code: String },
    /// The operation did not finish within the bound; the communicator was
    /// aborted.
    Timeout {
        what: String,
        after: Duration,
        /// A peer that published a failure in the store, if any did.
        culprit: Option<(usize, String)>,
    },
    /// The communicator was aborted (by [`accel_api::Communicator::abort`]
    /// or an earlier failure).
    Aborted,
    /// The library or device is not usable here.
    Unavailable(String),
    /// A receive got a message it did not expect.
    Protocol(String),
}

impl fmt::Display for NcclFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NcclFailure::Nccl {
                call,
                code,
                text,
                last,
            } => {
                write!(f, "{} failed: {text} (ncclResult {code})", call.name())?;
                if !last.is_empty() {
                    write!(f, ": {last}")?;
                }
                Ok(())
            }
            NcclFailure::Driver { call, code } => {
                write!(f, "CUDA driver call {call} failed: {code}")
            }
            NcclFailure::Timeout {
                what,
                culprit,
                after: _,
            } => {
                write!(
                    f,
                    "{what} did not complete; the NCCL communicator was aborted"
                )?;
                if let Some((r, why)) = culprit {
                    write!(f, "; rank {r} failed first: {why}")?;
                }
                Ok(())
            }
            NcclFailure::Aborted => f.write_str("the NCCL communicator was aborted"),
            NcclFailure::Unavailable(why) => f.write_str(why),
            NcclFailure::Protocol(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for NcclFailure {}

impl NcclFailure {
    /// A failed driver call.
    pub(crate) fn driver(call: &'static str, e: cudarc::driver::DriverError) -> NcclFailure {
        // `e.0`'s name only: DriverError's Debug calls into the driver.
        NcclFailure::Driver {
            call,
            code: format!("{:?}", e.0),
        }
    }
}

/// The one conversion: kind, fix and fatality from the failure.
impl From<NcclFailure> for Error {
    fn from(e: NcclFailure) -> Error {
        let msg = e.to_string();
        let err = match &e {
            NcclFailure::Nccl { code, .. } if *code == NCCL_REMOTE_ERROR || *code == NCCL_SYSTEM_ERROR => {
                Error::new(ErrorKind::PeerLost { peer: None }, msg)
                    .with_fix("a peer failed or left: look at the other ranks' logs for the first failure (NCCL_DEBUG=WARN shows NCCL's view)")
            }
            NcclFailure::Nccl { code, .. } if *code == NCCL_INVALID_ARGUMENT || *code == NCCL_INVALID_USAGE => {
                Error::new(ErrorKind::Backend, msg).with_fix(
                    "NCCL refused the call: one rank per GPU (NCCL refuses two ranks on one device), the same collectives in the same order on every rank (ACCEL_DEBUG=1 checks)",
                )
            }
            NcclFailure::Nccl { .. } => Error::new(ErrorKind::Backend, msg)
                .with_fix("rerun with NCCL_DEBUG=WARN for NCCL's detail"),
            NcclFailure::Driver { .. } => Error::new(ErrorKind::Backend, msg)
                .with_fix("the CUDA driver failed: check the device with nvidia-smi"),
            NcclFailure::Timeout {
                after, culprit, ..
            } => match culprit {
                Some((r, _)) => Error::new(ErrorKind::Timeout { after: *after }, msg)
                    .with_fix(format!("look at rank {r}'s log for why it failed")),
                None => timeout_error(*after, msg),
            },
            NcclFailure::Aborted => Error::new(ErrorKind::Aborted, msg),
            NcclFailure::Unavailable(_) => Error::new(ErrorKind::Unavailable, msg),
            NcclFailure::Protocol(_) => Error::new(ErrorKind::InvalidArgument, msg).with_fatal(false),
        };
        err.with_source(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nccl(code: u32) -> NcclFailure {
        NcclFailure::Nccl {
            call: NcclCall::AllReduce,
            code,
            text: "remote process exited or there was a network error".into(),
            last: "socket closed by peer".into(),
        }
    }

    #[test]
    fn remote_errors_are_lost_peers_and_fatal() {
        let e = Error::from(nccl(NCCL_REMOTE_ERROR));
        assert_eq!(e.kind(), &ErrorKind::PeerLost { peer: None });
        assert!(e.is_fatal_for_group());
        let s = e.to_string();
        // The call, and NCCL's last error.
        for part in ["ncclAllReduce failed", "socket closed by peer"] {
            assert!(s.contains(part), "`{part}` missing: {s}");
        }
    }

    #[test]
    fn timeouts_name_the_culprit_when_known() {
        let e = Error::from(NcclFailure::Timeout {
            what: "all_reduce of 4 f32 on cuda:0".into(),
            after: Duration::from_secs(2),
            culprit: Some((3, "out of memory".into())),
        });
        assert_eq!(
            e.kind(),
            &ErrorKind::Timeout {
                after: Duration::from_secs(2)
            }
        );
        assert!(
            e.to_string().contains("rank 3 failed first: out of memory"),
            "{e}"
        );
        assert!(e.fix().unwrap().contains("rank 3"));
        assert!(e.is_fatal_for_group());
    }

    #[test]
    fn protocol_errors_leave_the_group_usable() {
        let e = Error::from(NcclFailure::Protocol(
            "tag 3 expected, tag 4 arrived".into(),
        ));
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
        assert!(!e.is_fatal_for_group());
        let e = Error::from(NcclFailure::Unavailable("no device".into()));
        assert_eq!(e.kind(), &ErrorKind::Unavailable);
    }
}
