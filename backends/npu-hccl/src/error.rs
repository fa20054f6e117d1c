//! The crate's private error type and its one conversion to
//! [`accel_api::Error`].
//!
//! Everything the libraries report (an `HcclResult`, an `aclError`, a
//! failed `dlopen`) and everything the engine decides (a deadline passed, a
//! message of the wrong size) is an [`HcclError`] first; `From<HcclError>
//! for accel_api::Error` is the single place where it becomes a public
//! error kind with a fix. The group then adds the backend, rank and
//! operation.

use std::fmt;
use std::time::Duration;

use accel_api::kit::timeout_error;
use accel_api::{Error, ErrorKind};

/// `HCCL_E_NOT_SUPPORT`.
pub(crate) const HCCL_E_NOT_SUPPORT: i32 = 5;
/// `HCCL_E_TIMEOUT`.
pub(crate) const HCCL_E_TIMEOUT: i32 = 9;

/// The name of an `HcclResult` code, from `hccl_types.h`.
pub(crate) fn hccl_code_name(code: i32) -> &'static str {
    match code {
        0 => "HCCL_SUCCESS",
        1 => "HCCL_E_PARA",
        2 => "HCCL_E_PTR",
        3 => "HCCL_E_MEMORY",
        4 => "HCCL_E_INTERNAL",
        5 => "HCCL_E_NOT_SUPPORT",
        6 => "HCCL_E_NOT_FOUND",
        7 => "HCCL_E_UNAVAIL",
        8 => "HCCL_E_SYSCALL",
        9 => "HCCL_E_TIMEOUT",
        10 => "HCCL_E_OPEN_FILE_FAILURE",
        11 => "HCCL_E_TCP_CONNECT",
        12 => "HCCL_E_ROCE_CONNECT",
        13 => "HCCL_E_TCP_TRANSFER",
        14 => "HCCL_E_ROCE_TRANSFER",
        15 => "HCCL_E_RUNTIME",
        16 => "HCCL_E_DRV",
        17 => "HCCL_E_PROFILING",
        18 => "HCCL_E_CCE",
        19 => "HCCL_E_NETWORK",
        20 => "HCCL_E_AGAIN",
        21 => "HCCL_E_REMOTE",
        22 => "HCCL_E_SUSPENDING",
        23 => "HCCL_E_OPRETRY_FAIL",
        24 => "HCCL_E_OOM",
        _ => "unknown HcclResult",
    }
}

/// `true` for the codes that mean a connection to another rank broke.
fn is_link_failure(code: i32) -> bool {
    matches!(code, 11..=14 | 19 | 21)
}

/// What went wrong inside the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HcclError {
    /// A shared library could not be found or loaded.
    Load { library: String, detail: String },
    /// A symbol the backend uses is missing from a library.
    Symbol {
        library: String,
        symbol: &'static str,
        detail: String,
    },
    /// An AscendCL call returned a non-zero `aclError`.
    Acl {
        call: &'static str,
        code: i32,
        message: String,
    },
    /// An HCCL call returned (or the communicator reported, asynchronously)
    /// a non-zero `HcclResult`.
    Hccl {
        call: &'static str,
        code: i32,
        message: String,
    },
    /// No NPU is visible to this process.
    NoDevice { detail: String },
    /// The connect context names a device this backend cannot drive.
    Config { detail: String, fix: String },
    /// A deadline of the accel timeout passed while `what` was pending.
    Timeout { what: String, after: Duration },
    /// A received message (or a stored root info) does not match what the
    /// receiver expected; nothing was written.
    Mismatch { detail: String },
    /// A receive from this rank with no message sent to itself.
    NoSelfMessage { tag: u32 },
    /// A rendezvous value is not what a peer of this backend writes.
    Corrupt { detail: String },
    /// An invariant of the backend broke (a bug).
    Internal { detail: String },
}

/// `head`, followed by `: ` and the library's own text when it says
/// anything.
fn with_text(head: String, text: Option<String>) -> String {
    match text {
        Some(t) if !t.trim().is_empty() => format!("{head}: {}", t.trim()),
        _ => head,
    }
}

impl HcclError {
    /// The HCCL failure of `call` with `code` and HCCL's own description.
    pub(crate) fn hccl(call: &'static str, code: i32, text: Option<String>) -> HcclError {
        let name = hccl_code_name(code);
        let message = with_text(format!("{name} ({code})"), text);
        HcclError::Hccl {
            call,
            code,
            message,
        }
    }

    /// The AscendCL failure of `call` with `code` and ACL's recent message.
    pub(crate) fn acl(call: &'static str, code: i32, text: Option<String>) -> HcclError {
        let message = with_text(format!("aclError {code}"), text);
        HcclError::Acl {
            call,
            code,
            message,
        }
    }

    /// The reason the probe gives for this failure (no fix: the probe table
    /// shows reasons only).
    pub(crate) fn reason(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for HcclError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HcclError::Load { library, detail } => write!(f, "{library} {detail}"),
            HcclError::Symbol {
                library,
                symbol,
                detail,
            } => write!(f, "symbol `{symbol}` not found in {library}: {detail}"),
            HcclError::Acl {
                call,
                code: _,
                message,
            } => write!(f, "{call} failed: {message}"),
            HcclError::Hccl {
                call,
                code: _,
                message,
            } => write!(f, "{call} failed: {message}"),
            HcclError::NoDevice { detail } => write!(f, "no Ascend NPU visible: {detail}"),
            HcclError::Config { detail, .. } => f.write_str(detail),
            HcclError::Timeout { what, .. } => f.write_str(what),
            HcclError::Mismatch { detail } => f.write_str(detail),
            HcclError::NoSelfMessage { tag } => write!(
                f,
                "no device message from this rank to itself with tag {tag}"
            ),
            HcclError::Corrupt { detail } => f.write_str(detail),
            HcclError::Internal { detail } => f.write_str(detail),
        }
    }
}

impl std::error::Error for HcclError {}

/// The one conversion: kind, message and fix for every private failure.
impl From<HcclError> for Error {
    fn from(e: HcclError) -> Error {
        let text = e.to_string();
        let err = match &e {
            HcclError::Load { .. } | HcclError::Symbol { .. } => {
                Error::new(ErrorKind::Unavailable, text).with_fix(
                    "install the CANN toolkit and source its set_env.sh, or set ASCEND_TOOLKIT_HOME (or ACCEL_ASCEND_LIB_DIR) to the folder holding lib64/libascendcl.so and libhccl.so",
                )
            }
            HcclError::NoDevice { .. } => Error::new(ErrorKind::Unavailable, text).with_fix(
                "check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES",
            ),
            HcclError::Config { fix, .. } => {
                let fix = fix.clone();
                Error::new(ErrorKind::InvalidConfig, text).with_fix(fix)
            }
            HcclError::Acl { .. } => Error::new(ErrorKind::Backend, text)
                .with_fix("see the CANN log (ASCEND_PROCESS_LOG_PATH, default ~/ascend/log) for the cause"),
            HcclError::Hccl { code, .. } if is_link_failure(*code) => {
                Error::new(ErrorKind::PeerLost { peer: None }, text)
                    .with_fix("look at the other ranks' logs for the first failure; HCCL_IF_IP / HCCL_SOCKET_IFNAME pick the network HCCL uses")
            }
            HcclError::Hccl { code, .. } if *code == HCCL_E_NOT_SUPPORT => {
                Error::new(ErrorKind::Unsupported, text)
                    .with_fix("this NPU or CANN version lacks the operation for this element type")
            }
            HcclError::Hccl { .. } => Error::new(ErrorKind::Backend, text)
                .with_fix("see the CANN log (ASCEND_PROCESS_LOG_PATH, default ~/ascend/log) for the cause"),
            HcclError::Timeout { after, .. } => timeout_error(*after, text),
            HcclError::Mismatch { .. } => Error::new(ErrorKind::InvalidArgument, text)
                .with_fix("receive with a buffer of the size and element type that was sent"),
            HcclError::NoSelfMessage { .. } => Error::new(ErrorKind::InvalidArgument, text)
                .with_fix("send to self before receiving from self"),
            HcclError::Corrupt { .. } => Error::new(ErrorKind::Corrupt, text)
                .with_fix("every rank of a run must use the same accel version; check that no other program writes under this run's store prefix"),
            HcclError::Internal { .. } => Error::new(ErrorKind::Internal, text)
                .with_fix("this is a bug in accel: please report it with this message"),
        };
        err.with_source(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hccl_codes_map_to_kinds() {
        let e: Error = HcclError::hccl("HcclAllReduce", 13, Some("link down".into())).into();
        assert_eq!(e.kind(), &ErrorKind::PeerLost { peer: None });
        assert!(
            e.to_string()
                .contains("HCCL_E_TCP_TRANSFER (13): link down"),
            "{e}"
        );
        // HCCL's own timeout carries no bound here: the engine turns it into
        // `HcclError::Timeout` with the bound it derived HCCL_EXEC_TIMEOUT from.
        let e: Error = HcclError::hccl("HcclBroadcast", HCCL_E_TIMEOUT, None).into();
        assert_eq!(e.kind(), &ErrorKind::Backend, "{e}");
        let e: Error = HcclError::hccl("HcclReduce", 5, None).into();
        assert_eq!(e.kind(), &ErrorKind::Unsupported);
        assert!(!e.is_fatal_for_group());
        let e: Error = HcclError::hccl("HcclReduce", 4, None).into();
        assert_eq!(e.kind(), &ErrorKind::Backend);
        assert!(e.is_fatal_for_group());
        assert_eq!(hccl_code_name(99), "unknown HcclResult");
    }

    #[test]
    fn load_failures_are_unavailable_with_a_fix() {
        let e: Error = HcclError::Symbol {
            library: "/x/libhccl.so".into(),
            symbol: "HcclBarrier",
            detail: "undefined symbol".into(),
        }
        .into();
        assert_eq!(e.kind(), &ErrorKind::Unavailable);
        assert!(e.to_string().contains("`HcclBarrier`"), "{e}");
        assert!(e.fix().unwrap().contains("ASCEND_TOOLKIT_HOME"));
    }

    #[test]
    fn engine_decisions_keep_their_bound() {
        let e: Error = HcclError::Timeout {
            what: "stream still busy".into(),
            after: Duration::from_secs(3),
        }
        .into();
        assert_eq!(
            e.kind(),
            &ErrorKind::Timeout {
                after: Duration::from_secs(3)
            }
        );
        let e: Error = HcclError::Mismatch {
            detail: "8 bytes, wanted 4".into(),
        }
        .into();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
        assert!(!e.is_fatal_for_group());
    }
}
