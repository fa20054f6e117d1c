//! The crate's private error type, [`XlaError`], and its one conversion
//! into [`accel_api::Error`] (`impl From`). The group attaches the backend,
//! rank and operation to errors of collective calls; the probe and
//! `connect` attach their own.

use std::fmt;
use std::time::Duration;

use accel_api::kit::timeout_error;
use accel_api::{Error, ErrorKind};

/// What went wrong below accel's API.
#[derive(Debug, Clone)]
pub(crate) enum XlaError {
    /// The plugin file could not be loaded (missing, not a shared object,
    /// a missing dependency): dlopen's message.
    Load(String),
    /// The library has no `GetPjrtApi` entry point: not a PJRT plugin.
    Symbol(String),
    /// A PJRT plugin this backend cannot drive (API version, table size).
    Incompatible(String),
    /// A `PJRT_Error` returned by the plugin during the named call.
    Pjrt {
        during: String,
        code: i32,
        message: String,
    },
    /// The plugin broke a promise of the C API (a missing output), or the
    /// backend asked for something impossible: a bug.
    Broken(String),
    /// No plugin file was found where the backend looks.
    NotFound(String),
    /// The run's shape does not fit the process model (ranks in several
    /// processes, more ranks than devices).
    Config { what: String, fix: String },
    /// Rank threads did not arrive in time.
    Timeout { after: Duration, what: String },
    /// Another rank of the group failed first; this one stops too.
    PeerFailed { rank: usize, why: String },
    /// This rank's own group was aborted (the meeting broken by its own
    /// abort or failure): what the rank that broke it sees, instead of a
    /// lost peer naming itself.
    Aborted(String),
    /// A call's arguments do not fit what its peer sent (point-to-point
    /// sizes).
    Argument(String),
    /// Ranks made different calls in the same position (lengths, roots,
    /// operations): the group cannot go on.
    Mismatch(String),
}

/// `PJRT_Error_Code` names (absl status codes).
fn code_name(code: i32) -> &'static str {
    match code {
        1 => "CANCELLED",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        5 => "NOT_FOUND",
        6 => "ALREADY_EXISTS",
        7 => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        9 => "FAILED_PRECONDITION",
        10 => "ABORTED",
        11 => "OUT_OF_RANGE",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        15 => "DATA_LOSS",
        16 => "UNAUTHENTICATED",
        _ => "UNKNOWN",
    }
}

impl fmt::Display for XlaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            XlaError::Load(m) => write!(f, "cannot load the PJRT plugin: {m}"),
            XlaError::Symbol(m) => write!(f, "not a PJRT plugin (no GetPjrtApi): {m}"),
            XlaError::Incompatible(m) => write!(f, "incompatible PJRT plugin: {m}"),
            XlaError::Pjrt {
                during,
                code,
                message,
            } => write!(
                f,
                "{during} failed ({}): {}",
                code_name(*code),
                message.trim()
            ),
            XlaError::Broken(m) => write!(f, "PJRT misbehaved: {m}"),
            XlaError::NotFound(m)
            | XlaError::Argument(m)
            | XlaError::Mismatch(m)
            | XlaError::Aborted(m)
            | XlaError::Timeout { what: m, .. } => f.write_str(m),
            XlaError::Config { what, .. } => f.write_str(what),
            XlaError::PeerFailed { rank, why } => write!(f, "rank {rank} failed first: {why}"),
        }
    }
}

impl std::error::Error for XlaError {}

impl XlaError {
    /// `true` for failures that mean "this plugin cannot run here" (what a
    /// probe reports as unavailable).
    pub(crate) fn is_setup(&self) -> bool {
        match self {
            XlaError::Load(_)
            | XlaError::Symbol(_)
            | XlaError::Incompatible(_)
            | XlaError::NotFound(_) => true,
            XlaError::Pjrt { during, .. } => {
                during == "PJRT_Plugin_Initialize" || during == "PJRT_Client_Create"
            }
            _ => false,
        }
    }
}

const PLUGIN_FIX: &str = "run `make pjrt-setup` (scripts/fetch_pjrt_plugin.sh), or set ACCEL_PJRT_PLUGIN to a PJRT plugin (.so exporting GetPjrtApi)";

impl From<XlaError> for Error {
    fn from(e: XlaError) -> Error {
        let message = e.to_string();
        match e {
            _ if e.is_setup() => Error::new(ErrorKind::Unavailable, message).with_fix(PLUGIN_FIX),
            XlaError::Config { fix, .. } => {
                Error::new(ErrorKind::InvalidConfig, message).with_fix(fix)
            }
            XlaError::Timeout { after, .. } => timeout_error(after, message),
            XlaError::PeerFailed { rank, .. } => {
                Error::new(ErrorKind::PeerLost { peer: Some(rank) }, message)
                    .with_fix(format!("look at rank {rank}'s error for the first failure"))
            }
            XlaError::Broken(_) => Error::new(ErrorKind::Internal, message),
            XlaError::Aborted(_) => Error::new(ErrorKind::Aborted, message),
            XlaError::Argument(_) => Error::new(ErrorKind::InvalidArgument, message),
            XlaError::Mismatch(_) => Error::new(ErrorKind::InvalidArgument, message)
                .with_fatal(true)
                .with_fix("every rank must call the same collectives in the same order with the same lengths and roots (ACCEL_DEBUG=1 shows which)"),
            _ => Error::new(ErrorKind::Backend, message).with_source(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_failure() {
        let e = Error::from(XlaError::Load(
            "x.so: cannot open shared object file".into(),
        ));
        assert_eq!(e.kind(), &ErrorKind::Unavailable);
        assert!(e.fix().unwrap().contains("ACCEL_PJRT_PLUGIN"), "{e}");
        let e = Error::from(XlaError::Pjrt {
            during: "PJRT_Client_Compile".into(),
            code: 3,
            message: "bad MLIR\n".into(),
        });
        assert_eq!(e.kind(), &ErrorKind::Backend);
        assert!(e.to_string().contains("INVALID_ARGUMENT): bad MLIR"), "{e}");
        let e = Error::from(XlaError::Pjrt {
            during: "PJRT_Client_Create".into(),
            code: 2,
            message: "No visible GPU devices.".into(),
        });
        assert_eq!(e.kind(), &ErrorKind::Unavailable);
        let e = Error::from(XlaError::PeerFailed {
            rank: 2,
            why: "timeout".into(),
        });
        assert_eq!(e.kind(), &ErrorKind::PeerLost { peer: Some(2) });
    }
}
