//! The crate's private error type and its conversion to [`accel_api::Error`].
//!
//! Everything Gloo reports comes back from the shim as a status code plus a
//! message ([`GlooError`]). At the boundary of each communicator method it is
//! classified and turned into the public error with the rank, the operation
//! and the backend name attached.

use std::fmt;
use std::time::Duration;

use accel_api::kit::timeout_error;
use accel_api::{Error, ErrorKind};

use crate::name::NAME;

/// What the shim caught (one variant per status code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Caught {
    /// `gloo::IoException`: socket errors, lost peers, timeouts.
    Io,
    /// Any other `gloo::Exception`.
    Gloo,
    /// `gloo::EnforceNotMet`: an internal Gloo assertion.
    Enforce,
    /// Another `std::exception`.
    Std,
    /// Something that is not a `std::exception`.
    Unknown,
    /// A rendezvous store callback failed; the store adapter holds the
    /// real error.
    Store,
    /// The shim rejected an argument.
    Arg,
}

/// A failure reported by the shim.
#[derive(Debug, Clone)]
pub(crate) struct GlooError {
    pub(crate) caught: Caught,
    pub(crate) message: String,
}

impl GlooError {
    pub(crate) fn new(caught: Caught, message: impl Into<String>) -> GlooError {
        GlooError {
            caught,
            message: message.into(),
        }
    }
}

impl fmt::Display for GlooError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.caught {
            Caught::Io => "gloo::IoException",
            Caught::Gloo => "gloo::Exception",
            Caught::Enforce => "gloo::EnforceNotMet",
            Caught::Std => "std::exception",
            Caught::Unknown => "unknown C++ exception",
            Caught::Store => "rendezvous store",
            Caught::Arg => "shim argument check",
        };
        write!(f, "{what}: {}", self.message.trim())
    }
}

impl std::error::Error for GlooError {}

/// How a failure maps onto accel's error kinds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Class {
    Timeout,
    PeerLost(Option<usize>),
    InvalidArgument,
    Backend,
}

/// Every `[host]:port` token in a Gloo message, as Gloo prints addresses.
pub(crate) fn address_tokens(message: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let bytes = message.as_bytes();
    let mut i = 0;
    while let Some(off) = message[i..].find('[') {
        let start = i + off;
        let Some(close_off) = message[start..].find(']') else {
            break;
        };
        let close = start + close_off;
        let mut end = close + 1;
        if bytes.get(end) == Some(&b':') {
            end += 1;
            let digits_start = end;
            while bytes.get(end).is_some_and(u8::is_ascii_digit) {
                end += 1;
            }
            if end > digits_start {
                out.push(&message[start..end]);
            }
        }
        i = close + 1;
    }
    out
}

/// Classify a shim failure. `rank_of` maps an address Gloo printed for a
/// connection to the rank at its other end.
pub(crate) fn classify(e: &GlooError, rank_of: &dyn Fn(&str) -> Option<usize>) -> Class {
    match e.caught {
        Caught::Io => {
            let lower = e.message.to_ascii_lowercase();
            if lower.contains("timed out") || lower.contains("timeout") {
                return Class::Timeout;
            }
            let peer = address_tokens(&e.message).into_iter().find_map(rank_of);
            Class::PeerLost(peer)
        }
        Caught::Arg => Class::InvalidArgument,
        Caught::Gloo | Caught::Enforce | Caught::Std | Caught::Unknown | Caught::Store => {
            Class::Backend
        }
    }
}

/// Build the public error for a failure of `op` on `rank`.
pub(crate) fn to_api(
    e: GlooError,
    class: &Class,
    rank: usize,
    op: &str,
    timeout: Duration,
) -> Error {
    let detail = e.to_string();
    let err = match class {
        Class::Timeout => timeout_error(timeout, format!("Gloo gave up: {detail}")).with_op(op),
        Class::PeerLost(Some(p)) => Error::new(
            ErrorKind::PeerLost { peer: Some(*p) },
            format!("connection to rank {p} failed: {detail}"),
        )
        .with_fix(format!("look at rank {p}'s log for why it stopped")),
        Class::PeerLost(None) => Error::new(
            ErrorKind::PeerLost { peer: None },
            format!("a connection failed: {detail}"),
        )
        .with_fix("look at the other ranks' logs for the first failure"),
        Class::InvalidArgument => Error::new(ErrorKind::InvalidArgument, detail),
        Class::Backend => Error::new(ErrorKind::Backend, detail),
    };
    err.with_op(op)
        .with_backend(NAME)
        .with_rank(rank)
        .with_source(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_exact_addresses() {
        let m = "[/x/pair.cc:598] Connection closed by peer [127.0.0.1]:12345 and [::1]:7";
        assert_eq!(address_tokens(m), vec!["[127.0.0.1]:12345", "[::1]:7"]);
        assert!(address_tokens("no address").is_empty());
        assert!(address_tokens("[unterminated").is_empty());
    }

    #[test]
    fn classify_maps_addresses_to_ranks() {
        let table = [
            "[127.0.0.1]:1234".to_string(),
            String::new(),
            "[127.0.0.1]:12345".to_string(),
        ];
        let peers = |a: &str| table.iter().position(|p| !p.is_empty() && p == a);
        let e = GlooError::new(
            Caught::Io,
            "[pair.cc:598] Connection closed by peer [127.0.0.1]:12345",
        );
        assert_eq!(classify(&e, &peers), Class::PeerLost(Some(2)));
        let e = GlooError::new(Caught::Io, "Read error [127.0.0.1]:1234: reset");
        assert_eq!(classify(&e, &peers), Class::PeerLost(Some(0)));
        let e = GlooError::new(Caught::Io, "Read error [10.0.0.9]:1: reset");
        assert_eq!(classify(&e, &peers), Class::PeerLost(None));
        let e = GlooError::new(
            Caught::Io,
            "Timed out waiting 2000ms for recv operation to complete",
        );
        assert_eq!(classify(&e, &peers), Class::Timeout);
        let e = GlooError::new(Caught::Enforce, "x");
        assert_eq!(classify(&e, &peers), Class::Backend);
    }

    #[test]
    fn public_error_names_rank_op_backend() {
        let e = to_api(
            GlooError::new(Caught::Io, "Connection closed by peer [1.2.3.4]:5"),
            &Class::PeerLost(Some(3)),
            1,
            "all_reduce",
            Duration::from_secs(1),
        );
        let s = e.to_string();
        assert!(
            s.starts_with("[cpu-gloo rank 1] all_reduce: lost peer rank 3"),
            "{s}"
        );
        assert_eq!(e.kind(), &ErrorKind::PeerLost { peer: Some(3) });
    }
}
