use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// `Result` with accel's one public [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One rank's row in a [`ErrorKind::Mismatch`] table: what that rank called.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MismatchEntry {
    /// The rank the row describes.
    pub rank: usize,
    /// What the rank called, e.g. `#7 all_reduce f32 [1024] root=-`; `None`
    /// when the rank never reported (it is late, hung or dead).
    pub call: Option<String>,
}

/// What went wrong, in broad semantic kinds (OpenDAL's `ErrorKind`,
/// object_store's variants). Match on this; read the rest from [`Error`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A backend (or plugin) cannot run here: library missing, no device,
    /// wrong world size. The message says why.
    Unavailable,
    /// The operation, element type, reduction or device is outside what the
    /// backend declared in its [`Capabilities`](crate::Capabilities).
    Unsupported,
    /// Environment, flags or a configuration file are malformed or
    /// contradictory. The error names the variable or key and its value.
    InvalidConfig,
    /// An argument of a call is wrong: buffer lengths that do not match the
    /// group size, a root or peer out of range, an unknown spelling.
    InvalidArgument,
    /// A blocking call did not finish within its bound.
    Timeout {
        /// The bound that was exceeded.
        after: Duration,
    },
    /// A peer of the group went away (connection reset, process died).
    PeerLost {
        /// The rank that was lost, when known.
        peer: Option<usize>,
    },
    /// Ranks called different collectives (debug mode). One row per rank.
    Mismatch {
        /// What each rank called.
        table: Vec<MismatchEntry>,
    },
    /// A dynamically loaded plugin is broken.
    Plugin {
        /// The shared object.
        path: PathBuf,
        /// The symbol involved, if any.
        symbol: Option<String>,
    },
    /// An I/O error (file, socket) outside the collective engines.
    Io,
    /// The engine itself failed in a way none of the other kinds describes.
    Backend,
    /// A bug in accel itself (a planner invariant, a helper thread that
    /// died): not the user's input and not the engine. The message says
    /// what broke; please report it.
    Internal,
    /// The communicator failed earlier and refuses further work. The message
    /// names the first failure.
    Poisoned,
    /// A client presented a missing or wrong run token.
    Unauthorized,
    /// The operation was cancelled by an abort.
    Aborted,
    /// Stored data (a checkpoint, an offload file, a store value) is corrupt
    /// or truncated.
    Corrupt,
}

impl ErrorKind {
    /// Short stable name (`timeout`, `peer_lost`, ...), used in JSON output
    /// and across the plugin ABI.
    pub fn name(&self) -> &'static str {
        match self {
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::InvalidConfig => "invalid_config",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Timeout { .. } => "timeout",
            ErrorKind::PeerLost { .. } => "peer_lost",
            ErrorKind::Mismatch { .. } => "mismatch",
            ErrorKind::Plugin { .. } => "plugin",
            ErrorKind::Io => "io",
            ErrorKind::Backend => "backend",
            ErrorKind::Internal => "internal",
            ErrorKind::Poisoned => "poisoned",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::Aborted => "aborted",
            ErrorKind::Corrupt => "corrupt",
        }
    }
}

/// accel's one public error.
///
/// An error carries a [`kind`](Error::kind) to match on, a human message, and
/// the context a reader needs to act: the rank that saw it, the operation, the
/// backend, and a suggested fix. Backends keep private error types and convert
/// them here at their boundary, attaching the original as
/// [`source`](std::error::Error::source).
///
/// `Display` renders everything on one line:
///
/// ```text
/// [cpu-gloo rank 1] all_reduce: timed out after 30s: peer 0 did not answer (fix: ...)
/// ```
pub struct Error(Box<Inner>);

struct Inner {
    kind: ErrorKind,
    message: String,
    rank: Option<usize>,
    op: Option<String>,
    backend: Option<String>,
    fix: Option<String>,
    /// Overrides the kind's default of [`Error::is_fatal_for_group`].
    fatal: Option<bool>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Error {
    /// A new error of `kind` with a human message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error(Box::new(Inner {
            kind,
            message: message.into(),
            rank: None,
            op: None,
            backend: None,
            fix: None,
            fatal: None,
            source: None,
        }))
    }

    // Shorthands: the operation (or the variable) first, then what is
    // specific to the kind, then the message.

    /// Shorthand for an [`ErrorKind::Unsupported`] error about `op`.
    pub fn unsupported(op: impl Into<String>, message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Unsupported, message).with_op(op)
    }

    /// Shorthand for an [`ErrorKind::Internal`] error (a bug in accel)
    /// found during `op`.
    pub fn internal(op: impl Into<String>, message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Internal, message)
            .with_op(op)
            .with_fix("this is a bug in accel: please report it with this message")
    }

    /// Shorthand for an [`ErrorKind::InvalidConfig`] error naming `variable`
    /// and the offending `value`.
    pub fn invalid_config(variable: &str, value: &str, why: impl fmt::Display) -> Error {
        Error::new(
            ErrorKind::InvalidConfig,
            format!("{variable}={value:?}: {why}"),
        )
    }

    /// Shorthand for an [`ErrorKind::InvalidArgument`] error about `op`.
    pub fn invalid_argument(op: impl Into<String>, message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidArgument, message).with_op(op)
    }

    /// Shorthand for an [`ErrorKind::Io`] error with context.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::new(ErrorKind::Io, format!("{}: {source}", context.into())).with_source(source)
    }

    /// Shorthand for an [`ErrorKind::Timeout`] error of `op` after `after`.
    pub fn timeout(op: impl Into<String>, after: Duration, message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Timeout { after }, message).with_op(op)
    }

    /// Attach the rank that observed the error (kept if already set).
    pub fn with_rank(mut self, rank: usize) -> Error {
        self.0.rank.get_or_insert(rank);
        self
    }

    /// Attach the operation (kept if already set).
    pub fn with_op(mut self, op: impl Into<String>) -> Error {
        if self.0.op.is_none() {
            self.0.op = Some(op.into());
        }
        self
    }

    /// Replace the operation: an error of an engine call the group made on
    /// behalf of another (the call check's all-gather) names the caller's.
    pub(crate) fn replace_op(mut self, op: impl Into<String>) -> Error {
        self.0.op = Some(op.into());
        self
    }

    /// Attach the backend name (kept if already set).
    pub fn with_backend(mut self, backend: impl Into<String>) -> Error {
        if self.0.backend.is_none() {
            self.0.backend = Some(backend.into());
        }
        self
    }

    /// Append `detail` to the message (`message; detail`), keeping the kind
    /// and the context: what a layer that knows more adds on the way out.
    pub fn with_detail(mut self, detail: impl fmt::Display) -> Error {
        self.0.message = format!("{}; {detail}", self.0.message);
        self
    }

    /// Attach a suggested fix (replaces an earlier one).
    pub fn with_fix(mut self, fix: impl Into<String>) -> Error {
        self.0.fix = Some(fix.into());
        self
    }

    /// Declare whether this error leaves the communicator that saw it
    /// unusable, overriding the kind's default (see
    /// [`is_fatal_for_group`](Error::is_fatal_for_group)). An engine that
    /// knows better than the kind says so here: a `Backend` error that left
    /// the engine intact is `with_fatal(false)`, an `InvalidArgument` found
    /// half-way through a protocol is `with_fatal(true)`.
    pub fn with_fatal(mut self, fatal: bool) -> Error {
        self.0.fatal = Some(fatal);
        self
    }

    /// Attach the underlying cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Error {
        self.0.source = Some(Box::new(source));
        self
    }

    /// Attach an already boxed cause.
    pub fn with_boxed_source(mut self, source: Box<dyn std::error::Error + Send + Sync>) -> Error {
        self.0.source = Some(source);
        self
    }

    /// What went wrong.
    pub fn kind(&self) -> &ErrorKind {
        &self.0.kind
    }

    /// The human message, without the context prefix.
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// The rank that observed the error.
    pub fn rank(&self) -> Option<usize> {
        self.0.rank
    }

    /// The operation that failed.
    pub fn op(&self) -> Option<&str> {
        self.0.op.as_deref()
    }

    /// The backend that failed.
    pub fn backend(&self) -> Option<&str> {
        self.0.backend.as_deref()
    }

    /// The suggested fix.
    pub fn fix(&self) -> Option<&str> {
        self.0.fix.as_deref()
    }

    /// `true` when the communicator that returned this error must be
    /// considered broken, so that every later call fails with
    /// [`ErrorKind::Poisoned`]. Set explicitly with
    /// [`with_fatal`](Error::with_fatal); otherwise decided by the kind:
    /// timeout, lost peer, mismatch, abort, engine failure, internal bug and
    /// poisoned are fatal, the rest (bad arguments, unsupported calls,
    /// configuration) are not.
    pub fn is_fatal_for_group(&self) -> bool {
        if let Some(f) = self.0.fatal {
            return f;
        }
        matches!(
            self.0.kind,
            ErrorKind::Timeout { .. }
                | ErrorKind::PeerLost { .. }
                | ErrorKind::Mismatch { .. }
                | ErrorKind::Aborted
                | ErrorKind::Backend
                | ErrorKind::Internal
                | ErrorKind::Poisoned
        )
    }

    /// A copy with the same kind, message and context but the source rendered
    /// to text (errors are not `Clone` because sources are not).
    pub fn snapshot(&self) -> Error {
        let mut e = Error::new(self.0.kind.clone(), self.0.message.clone());
        e.0.rank = self.0.rank;
        e.0.op = self.0.op.clone();
        e.0.backend = self.0.backend.clone();
        e.0.fix = self.0.fix.clone();
        e.0.fatal = self.0.fatal;
        e
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Debug is what `unwrap()` and `main() -> Result` print: make it the
        // readable form, then the kind for matching by eye.
        write!(f, "{self} [kind: {}]", self.0.kind.name())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.0.backend, self.0.rank) {
            (Some(b), Some(r)) => write!(f, "[{b} rank {r}] ")?,
            (Some(b), None) => write!(f, "[{b}] ")?,
            (None, Some(r)) => write!(f, "[rank {r}] ")?,
            (None, None) => {}
        }
        if let Some(op) = &self.0.op {
            write!(f, "{op}: ")?;
        }
        match &self.0.kind {
            ErrorKind::Timeout { after } => write!(f, "timed out after {after:?}: ")?,
            ErrorKind::PeerLost { peer: Some(p) } => write!(f, "lost peer rank {p}: ")?,
            ErrorKind::PeerLost { peer: None } => write!(f, "lost a peer: ")?,
            ErrorKind::Plugin { path, symbol } => {
                write!(f, "plugin {}", path.display())?;
                if let Some(s) = symbol {
                    write!(f, " (symbol `{s}`)")?;
                }
                write!(f, ": ")?;
            }
            ErrorKind::Unsupported => write!(f, "unsupported: ")?,
            ErrorKind::Unauthorized => write!(f, "unauthorized: ")?,
            ErrorKind::Poisoned => write!(f, "communicator poisoned: ")?,
            _ => {}
        }
        f.write_str(&self.0.message)?;
        if let ErrorKind::Mismatch { table } = &self.0.kind {
            write!(f, "; per-rank calls:")?;
            for row in table {
                match &row.call {
                    Some(c) => write!(f, " | rank {}: {c}", row.rank)?,
                    None => write!(f, " | rank {}: <no report>", row.rank)?,
                }
            }
        }
        if let Some(fix) = &self.0.fix {
            write!(f, " (fix: {fix})")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0
            .source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Every I/O error becomes [`ErrorKind::Io`]: an OS-level `TimedOut` does
/// not say which bound was exceeded, so it is not turned into a
/// [`ErrorKind::Timeout`] (whose `after` would be invented). Code that owns
/// a deadline reports its own `Timeout` with the real bound.
impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::new(ErrorKind::Io, e.to_string()).with_source(e)
    }
}

/// candle's errors (with the `candle` feature, which accel-candle turns
/// on): [`ErrorKind::Backend`] with candle's message, the original as the
/// source, so that `?` takes a candle call's error in code that returns
/// accel's (a `backward` closure, a training `main`). The impl lives here
/// because the orphan rule allows it only beside one of the two types.
#[cfg(feature = "candle")]
impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Error {
        Error::new(ErrorKind::Backend, format!("candle: {e}")).with_source(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_backend_rank_op_and_fix() {
        let e = Error::timeout(
            "all_reduce",
            Duration::from_secs(30),
            "peer 0 did not answer",
        )
        .with_backend("cpu-gloo")
        .with_rank(1)
        .with_fix("raise ACCEL_TIMEOUT");
        let s = e.to_string();
        assert_eq!(
            s,
            "[cpu-gloo rank 1] all_reduce: timed out after 30s: peer 0 did not answer (fix: raise ACCEL_TIMEOUT)"
        );
        assert!(e.is_fatal_for_group());
    }

    #[test]
    fn mismatch_renders_every_rank() {
        let e = Error::new(
            ErrorKind::Mismatch {
                table: vec![
                    MismatchEntry {
                        rank: 0,
                        call: Some("#3 all_reduce f32 [4]".into()),
                    },
                    MismatchEntry {
                        rank: 1,
                        call: None,
                    },
                ],
            },
            "ranks disagree",
        );
        let s = e.to_string();
        assert!(s.contains("rank 0: #3 all_reduce f32 [4]"), "{s}");
        assert!(s.contains("rank 1: <no report>"), "{s}");
    }

    #[test]
    fn fatality_is_a_property_of_the_error() {
        assert!(Error::new(ErrorKind::Backend, "x").is_fatal_for_group());
        assert!(!Error::new(ErrorKind::Backend, "x")
            .with_fatal(false)
            .is_fatal_for_group());
        assert!(!Error::invalid_argument("recv", "x").is_fatal_for_group());
        let e = Error::invalid_argument("recv", "x").with_fatal(true);
        assert!(e.is_fatal_for_group());
        assert!(e.snapshot().is_fatal_for_group());
        assert!(Error::internal("plan", "x").is_fatal_for_group());
    }

    #[test]
    fn io_errors_never_invent_a_timeout() {
        let e: Error = std::io::Error::from(std::io::ErrorKind::TimedOut).into();
        assert_eq!(e.kind(), &ErrorKind::Io);
        let e: Error = std::io::Error::from(std::io::ErrorKind::WouldBlock).into();
        assert_eq!(e.kind(), &ErrorKind::Io);
    }

    #[test]
    fn first_context_wins() {
        let e = Error::new(ErrorKind::Backend, "x")
            .with_rank(2)
            .with_rank(3)
            .with_op("a")
            .with_op("b");
        assert_eq!(e.rank(), Some(2));
        assert_eq!(e.op(), Some("a"));
    }
}
