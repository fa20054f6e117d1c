//! The TCP store client.

use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use accel_api::{CasOutcome, Error, ErrorKind, Result, Store};

use super::wire::{
    read_frame, write_frame, DecodeError, FrameError, Request, Response, WireErrorKind, MAX_FRAME,
};
use crate::memory::missing_keys_error;
use accel_api::sync::lock;

/// Added to a request's own timeout to bound each socket read and write: the
/// server answers a blocking request when its timeout passes, so the reply
/// needs a little longer than that to arrive.
pub(crate) const IO_MARGIN: Duration = Duration::from_secs(2);
/// The longest single TCP connect attempt.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(5);
/// Idle connections kept for blocking calls.
const POOL_MAX: usize = 4;

const FIX_TOKEN: &str = "export the same ACCEL_RUN_TOKEN on every machine of the run \
                         (the launcher generates one and passes it to its workers)";
const FIX_SERVER_GONE: &str = "check that the process hosting the store (the launcher or \
                               rank 0) is still running; its log says why it stopped";

/// A client of [`TcpStoreServer`](crate::TcpStoreServer).
///
/// `Send + Sync`: share one client between threads (`Arc<TcpStore>`).
///
/// # Connections
///
/// Short requests (`set`, `try_get`, `add`, `compare_set`, `delete`) share
/// one *control* connection, one request at a time. Blocking requests (`get`,
/// `wait`) each take a connection of their own from a small pool (opened on
/// demand, at most 4 kept idle), so that a thread waiting in `get` never
/// stops another thread's `set` on the same client. A connection that saw
/// an error is dropped; the next call opens a new one (one attempt, no
/// retry: a server that went away is reported, not waited for).
///
/// # Timeouts
///
/// Every socket read and write is bounded: by the request's timeout plus a
/// 2 s margin for `get`/`wait`, and by the client's `timeout` (from
/// [`connect`](TcpStore::connect)) for everything else. When the server dies
/// or the connection breaks, every call fails within that bound with an
/// error naming the server address ([`ErrorKind::PeerLost`] when the
/// connection was closed or reset, [`ErrorKind::Io`] for other socket
/// errors, [`ErrorKind::Timeout`] when the server stopped answering).
pub struct TcpStore {
    addr: String,
    token: Option<String>,
    timeout: Duration,
    control: Mutex<Option<Conn>>,
    pool: Mutex<Vec<Conn>>,
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the token.
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// One authenticated connection.
struct Conn {
    stream: TcpStream,
}

/// Why a request on a connection failed.
enum CallError {
    /// The socket failed, timed out, or the peer closed it.
    Frame(FrameError),
    /// The reply did not decode.
    Decode(DecodeError),
}

/// Why opening a connection failed.
enum OpenError {
    /// Worth retrying while connecting: refused, unreachable, reset.
    Transient(io::Error),
    /// Final: refused token, protocol mismatch, not an accel store.
    Final(Error),
}

fn is_protocol_error(r: &Response) -> bool {
    matches!(
        r,
        Response::Error {
            kind: WireErrorKind::Protocol,
            ..
        }
    )
}

fn nonzero(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

impl Conn {
    fn call(
        &mut self,
        frame: &[u8],
        io_timeout: Duration,
    ) -> std::result::Result<Response, CallError> {
        let t = Some(nonzero(io_timeout));
        self.stream
            .set_write_timeout(t)
            .and_then(|()| self.stream.set_read_timeout(t))
            .map_err(|e| CallError::Frame(FrameError::Io(e)))?;
        write_frame(&mut self.stream, frame).map_err(|e| CallError::Frame(FrameError::Io(e)))?;
        let payload = read_frame(&mut self.stream, MAX_FRAME).map_err(CallError::Frame)?;
        Response::decode(&payload).map_err(CallError::Decode)
    }
}

impl TcpStore {
    /// Connect to the store server at `addr` (`"host:port"` or a
    /// [`SocketAddr`]) and authenticate with `token`.
    ///
    /// Connection failures (refused, unreachable, name not resolving yet)
    /// are retried with a growing backoff until `timeout` passes, since the
    /// server may start a moment after its clients. `timeout` is also the
    /// bound of every later non-blocking request. An empty token counts as
    /// no token.
    ///
    /// # Errors
    /// * [`ErrorKind::Timeout`] when the server could not be reached in time,
    ///   naming the address and the last error.
    /// * [`ErrorKind::Unauthorized`] when the server refused the token (not
    ///   retried).
    /// * [`ErrorKind::InvalidConfig`] when the server speaks another
    ///   protocol version, or `addr` is not an accel store server.
    pub fn connect<A: ToSocketAddrs + fmt::Display>(
        addr: A,
        token: Option<&str>,
        timeout: Duration,
    ) -> Result<TcpStore> {
        let store = TcpStore {
            addr: addr.to_string(),
            token: token.filter(|t| !t.is_empty()).map(str::to_string),
            timeout,
            control: Mutex::new(None),
            pool: Mutex::new(Vec::new()),
        };
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        let mut backoff = Duration::from_millis(10);
        let mut attempts = 0u32;
        let conn = loop {
            attempts += 1;
            let left = deadline.map_or(CONNECT_ATTEMPT, |d| {
                d.saturating_duration_since(Instant::now())
            });
            match store.open(left.min(CONNECT_ATTEMPT)) {
                Ok(c) => break c,
                Err(OpenError::Final(e)) => return Err(e),
                Err(OpenError::Transient(e)) => {
                    let left = deadline.map_or(Duration::MAX, |d| {
                        d.saturating_duration_since(Instant::now())
                    });
                    if left.is_zero() {
                        return Err(Error::timeout(
                            "store connect",
                            timeout,
                            format!(
                                "could not reach the store server at {} ({attempts} attempt(s) \
                                 in {:.1?}; last error: {e})",
                                store.describe(),
                                start.elapsed()
                            ),
                        )
                        .with_fix(
                            "check that the launcher (or rank 0) is running and hosts the \
                             store at this address (MASTER_ADDR / MASTER_PORT), that this \
                             machine can reach it (firewall, interface), and raise the \
                             timeout if it starts late",
                        )
                        .with_source(e));
                    }
                    tracing::trace!(addr = %store.addr, "store not reachable yet: {e}");
                    std::thread::sleep(backoff.min(left));
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
            }
        };
        *lock(&store.control) = Some(conn);
        Ok(store)
    }

    /// The bound of non-blocking requests, as given to
    /// [`connect`](Self::connect).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// One attempt to connect and authenticate, each step bounded by `limit`.
    fn open(&self, limit: Duration) -> std::result::Result<Conn, OpenError> {
        let limit = nonzero(limit);
        let addrs: Vec<SocketAddr> = self
            .addr
            .as_str()
            .to_socket_addrs()
            .map_err(OpenError::Transient)?
            .collect();
        let mut last = io::Error::new(
            io::ErrorKind::NotFound,
            format!("`{}` resolves to no address", self.addr),
        );
        let mut stream = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, limit) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let stream = stream.ok_or(OpenError::Transient(last))?;
        stream.set_nodelay(true).map_err(OpenError::Transient)?;
        let mut conn = Conn { stream };
        let hello = Request::hello(self.token.as_deref())
            .encode()
            .map_err(|_| {
                OpenError::Final(Error::new(
                    ErrorKind::InvalidConfig,
                    "the run token is too long for the store protocol",
                ))
            })?;
        match conn.call(&hello, limit) {
            Ok(Response::Ok) => Ok(conn),
            Ok(Response::Refused { message }) => Err(OpenError::Final(
                Error::new(
                    ErrorKind::Unauthorized,
                    format!(
                        "the store server at {} refused this client's run token: {message}",
                        self.describe()
                    ),
                )
                .with_op("store connect")
                .with_fix(FIX_TOKEN),
            )),
            Ok(Response::VersionMismatch { server_version }) => Err(OpenError::Final(
                Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "the store server at {} speaks protocol version {server_version}, \
                         this client version {}",
                        self.describe(),
                        super::wire::PROTOCOL_VERSION
                    ),
                )
                .with_op("store connect")
                .with_fix("use the same accel version on every machine of the run"),
            )),
            // At its connection limit: try again while the timeout lasts.
            Ok(Response::Busy { message }) => Err(OpenError::Transient(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!("the store server is busy: {message}"),
            ))),
            Ok(other) => Err(OpenError::Final(self.not_a_store(&format!("{other:?}")))),
            Err(CallError::Decode(e)) => Err(OpenError::Final(self.not_a_store(&e.to_string()))),
            Err(CallError::Frame(FrameError::TooLarge { len, .. })) => Err(OpenError::Final(
                self.not_a_store(&format!("a {len}-byte frame")),
            )),
            Err(CallError::Frame(FrameError::Closed)) => Err(OpenError::Transient(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the server closed the connection during the hello",
            ))),
            Err(CallError::Frame(FrameError::Io(e))) => Err(OpenError::Transient(e)),
        }
    }

    fn not_a_store(&self, what: &str) -> Error {
        Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "{} did not answer like an accel store server (got {what})",
                self.describe()
            ),
        )
        .with_op("store connect")
        .with_fix("check MASTER_ADDR / MASTER_PORT: another service listens on that port")
    }

    /// A connection opened after the first: one attempt, errors name the server.
    fn reopen(&self, op: &str) -> Result<Conn> {
        self.open(self.timeout.min(CONNECT_ATTEMPT))
            .map_err(|e| match e {
                OpenError::Final(e) => e,
                OpenError::Transient(e) => Error::new(
                    ErrorKind::Io,
                    format!("cannot reach the store server at {}: {e}", self.describe()),
                )
                .with_op(op.to_string())
                .with_fix(FIX_SERVER_GONE)
                .with_source(e),
            })
    }

    fn encode(&self, op: &str, what: &str, req: &Request) -> Result<Vec<u8>> {
        req.encode().map_err(|len| {
            Error::invalid_argument(
                op.to_string(),
                format!(
                    "{what} makes a {len}-byte request; the TCP store carries at most \
                     {MAX_FRAME} bytes per request"
                ),
            )
        })
    }

    /// Turn a failed call into an error naming the server, `op` and `what`.
    fn call_error(&self, op: &str, what: &str, e: CallError, io_timeout: Duration) -> Error {
        let server = self.describe();
        match e {
            CallError::Decode(d) => Error::new(
                ErrorKind::Io,
                format!("malformed reply from the store server at {server} to {what}: {d}"),
            )
            .with_op(op.to_string()),
            CallError::Frame(FrameError::TooLarge { len, max }) => Error::new(
                ErrorKind::Io,
                format!(
                    "the store server at {server} answered {what} with a {len}-byte frame \
                     (limit {max})"
                ),
            )
            .with_op(op.to_string()),
            CallError::Frame(FrameError::Closed) => Error::new(
                ErrorKind::PeerLost { peer: None },
                format!("the store server at {server} closed the connection during {what}"),
            )
            .with_op(op.to_string())
            .with_fix(FIX_SERVER_GONE),
            CallError::Frame(FrameError::Io(e)) => {
                let kind = match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        return Error::timeout(
                            op.to_string(),
                            io_timeout,
                            format!("the store server at {server} did not answer {what}"),
                        )
                        .with_fix(FIX_SERVER_GONE)
                        .with_source(e)
                    }
                    io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::NotConnected => ErrorKind::PeerLost { peer: None },
                    _ => ErrorKind::Io,
                };
                Error::new(
                    kind,
                    format!(
                        "lost the connection to the store server at {server} during {what}: {e}"
                    ),
                )
                .with_op(op.to_string())
                .with_fix(FIX_SERVER_GONE)
                .with_source(e)
            }
        }
    }

    /// A short request on the control connection.
    fn quick(&self, op: &str, what: &str, req: &Request) -> Result<Response> {
        let frame = self.encode(op, what, req)?;
        let mut control = lock(&self.control);
        let conn = match control.as_mut() {
            Some(c) => c,
            None => control.insert(self.reopen(op)?),
        };
        let io_timeout = self.timeout.saturating_add(IO_MARGIN);
        match conn.call(&frame, io_timeout) {
            Ok(r) => {
                if is_protocol_error(&r) {
                    // The server closes the connection after those.
                    *control = None;
                }
                self.check(op, what, r)
            }
            Err(e) => {
                *control = None;
                Err(self.call_error(op, what, e, io_timeout))
            }
        }
    }

    /// A blocking request (`get`, `wait`) on a pooled connection of its own.
    fn blocking(&self, op: &str, what: &str, req: &Request, timeout: Duration) -> Result<Response> {
        let frame = self.encode(op, what, req)?;
        let pooled = lock(&self.pool).pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => self.reopen(op)?,
        };
        let io_timeout = timeout.saturating_add(IO_MARGIN);
        match conn.call(&frame, io_timeout) {
            Ok(r) => {
                let mut pool = lock(&self.pool);
                if pool.len() < POOL_MAX && !is_protocol_error(&r) {
                    pool.push(conn);
                }
                drop(pool);
                self.check(op, what, r)
            }
            Err(e) => Err(self.call_error(op, what, e, io_timeout)),
        }
    }

    /// Turn error replies into errors; pass the others through.
    fn check(&self, op: &str, what: &str, r: Response) -> Result<Response> {
        match r {
            Response::Error { kind, message } => {
                let kind = match kind {
                    WireErrorKind::Corrupt => ErrorKind::Corrupt,
                    WireErrorKind::InvalidArgument => ErrorKind::InvalidArgument,
                    WireErrorKind::Protocol => ErrorKind::Io,
                };
                Err(Error::new(
                    kind,
                    format!(
                        "{what} failed on the store server {}: {message}",
                        self.describe()
                    ),
                )
                .with_op(op.to_string()))
            }
            other => Ok(other),
        }
    }

    /// A [`quick`](Self::quick) call whose answer `read` takes, or hands
    /// back as out of protocol.
    fn ask<T>(
        &self,
        op: &str,
        what: &str,
        req: &Request,
        read: impl FnOnce(Response) -> std::result::Result<T, Response>,
    ) -> Result<T> {
        read(self.quick(op, what, req)?).map_err(|r| self.unexpected(op, what, r))
    }

    fn unexpected(&self, op: &str, what: &str, r: Response) -> Error {
        // The connection that carried it was already returned; a server
        // answering out of protocol is a bug, not a network condition.
        Error::new(
            ErrorKind::Io,
            format!(
                "the store server at {} answered {what} with an unexpected {r:?}",
                self.describe()
            ),
        )
        .with_op(op.to_string())
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let req = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        self.ask("store set", &format!("set `{key}`"), &req, |r| match r {
            Response::Ok => Ok(()),
            r => Err(r),
        })
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let (op, what) = ("store get", format!("get `{key}`"));
        let req = Request::Get {
            key: key.to_string(),
            timeout,
        };
        match self.blocking(op, &what, &req, timeout)? {
            Response::Value(v) => Ok(v),
            Response::Timeout { missing } => {
                Err(missing_keys_error(op, &missing, timeout, &self.describe()))
            }
            r => Err(self.unexpected(op, &what, r)),
        }
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let req = Request::TryGet {
            key: key.to_string(),
        };
        self.ask(
            "store try_get",
            &format!("try_get `{key}`"),
            &req,
            |r| match r {
                Response::Maybe(v) => Ok(v),
                r => Err(r),
            },
        )
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let req = Request::Add {
            key: key.to_string(),
            delta,
        };
        self.ask("store add", &format!("add to `{key}`"), &req, |r| match r {
            Response::Int(v) => Ok(v),
            r => Err(r),
        })
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        let req = Request::CompareSet {
            key: key.to_string(),
            expected: expected.map(<[u8]>::to_vec),
            desired: new.to_vec(),
        };
        let what = format!("compare_set `{key}`");
        self.ask("store compare_set", &what, &req, |r| match r {
            Response::Swapped => Ok(CasOutcome::Swapped),
            Response::Maybe(v) => Ok(CasOutcome::Current(v)),
            r => Err(r),
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let (op, what) = ("store wait", format!("wait for {}", keys.join(", ")));
        let req = Request::Wait {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            timeout,
        };
        match self.blocking(op, &what, &req, timeout)? {
            Response::Ok => Ok(()),
            Response::Timeout { missing } => {
                Err(missing_keys_error(op, &missing, timeout, &self.describe()))
            }
            r => Err(self.unexpected(op, &what, r)),
        }
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let req = Request::Delete {
            key: key.to_string(),
        };
        self.ask(
            "store delete",
            &format!("delete `{key}`"),
            &req,
            |r| match r {
                Response::Bool(b) => Ok(b),
                r => Err(r),
            },
        )
    }

    fn describe(&self) -> String {
        format!("tcp://{}", self.addr)
    }
}
