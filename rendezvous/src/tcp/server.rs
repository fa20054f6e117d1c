//! The TCP store server: a [`MemoryStore`] behind a socket. New
//! connections wait for their hello in one event loop
//! ([`handshake`](super::handshake)); each authenticated connection is then
//! served by its own thread.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use accel_api::{CasOutcome, Error, ErrorKind, Result, Store};

use super::handshake::{self, ServerLimits, LISTENER, WAKER};
use super::wire::{
    read_frame, write_frame, FrameError, Request, Response, WireErrorKind, MAX_FRAME,
};
use crate::memory::{MemoryStore, Waited};

/// How long the server waits for a client to take a reply off the socket.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// The server side of the TCP store, hosted by the launcher (or rank 0).
///
/// Its state is a [`MemoryStore`] (see [`store`](TcpStoreServer::store)).
/// New connections are held by one event-loop thread until their hello is
/// complete, so connections that never authenticate cost a socket and a
/// few bytes, not a thread. Within [`ServerLimits`]: the hello must be
/// complete within `handshake_timeout` (10 s) of the accept, at most
/// `max_handshakes` (512) connections wait for theirs (the oldest is
/// dropped for a newer one), and at most `max_connections` (4096)
/// authenticated connections are served, each by its own thread. Refusals
/// are logged at most five per 10 s, then as one line with their count.
///
/// Blocking `get` / `wait` requests carry their timeout and are answered
/// with the keys still missing when it passes, so no connection is held
/// forever. (A client killed in the middle of a `get` leaves its server
/// thread waiting until that request's timeout; the thread then finds the
/// connection closed and exits.) Authenticated connections may stay idle
/// for the whole run: the server puts no read timeout on them, only a 30 s
/// write timeout on its replies.
///
/// # Authentication
///
/// With a token, the first frame of every connection must be a hello
/// carrying the same token (compared in constant time); otherwise the server
/// answers with a refusal, logs a warning naming the peer address, and
/// closes the connection. An empty token counts as no token.
///
/// # Shutdown
///
/// [`shutdown`](TcpStoreServer::shutdown) (or dropping the server) stops
/// accepting, closes every connection, and wakes every blocked request, so
/// that each client fails promptly with an error naming this server instead
/// of waiting out its timeout.
pub struct TcpStoreServer {
    shared: Arc<Shared>,
    waker: mio::Waker,
    accept: Mutex<Option<JoinHandle<()>>>,
}

pub(crate) struct Shared {
    store: Arc<MemoryStore>,
    pub(crate) token: Option<String>,
    pub(crate) local_addr: SocketAddr,
    pub(crate) limits: ServerLimits,
    pub(crate) stopping: AtomicBool,
    /// Authenticated connections being served (clones, to shut them down).
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
}

impl Shared {
    pub(crate) fn conns(&self) -> MutexGuard<'_, HashMap<u64, TcpStream>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("TcpStoreServer")
            .field("local_addr", &self.shared.local_addr)
            .field("authenticated", &self.shared.token.is_some())
            .field("limits", &self.shared.limits)
            .field("stopping", &self.shared.stopping.load(Ordering::SeqCst))
            .finish()
    }
}

impl TcpStoreServer {
    /// Bind `addr` and start serving.
    ///
    /// Port 0 picks a free port; read it back with
    /// [`local_addr`](Self::local_addr). Prefer a loopback address (see
    /// [`bind_loopback`](Self::bind_loopback)) for single-machine runs; a
    /// server reachable from other machines without a `token` logs a warning.
    ///
    /// # Errors
    /// [`ErrorKind::Io`] naming `addr` when it cannot be bound (in use, not
    /// a local address, permission).
    pub fn bind(addr: SocketAddr, token: Option<String>) -> Result<TcpStoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            Error::io(format!("cannot bind the store server to {addr}"), e)
                .with_op("store server bind")
                .with_fix(
                    "choose another port (MASTER_PORT, or 0 for a free one) \
                     or an address of this machine",
                )
        })?;
        TcpStoreServer::from_listener(listener, token)
    }

    /// Bind `127.0.0.1:port` (port 0: a free one): the default for runs on
    /// one machine, unreachable from others.
    ///
    /// # Errors
    /// As [`bind`](Self::bind).
    pub fn bind_loopback(port: u16, token: Option<String>) -> Result<TcpStoreServer> {
        TcpStoreServer::bind(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port), token)
    }

    /// Serve on a listener bound by the caller, so that the launcher can bind
    /// first (port 0 included) and hand the socket over without a
    /// probe-then-bind race. Default [`ServerLimits`].
    ///
    /// # Errors
    /// [`ErrorKind::Io`] when the listener's address cannot be read or the
    /// event loop cannot be started.
    pub fn from_listener(listener: TcpListener, token: Option<String>) -> Result<TcpStoreServer> {
        TcpStoreServer::from_listener_with(listener, token, ServerLimits::default())
    }

    /// [`from_listener`](Self::from_listener) with explicit bounds on the
    /// connections the server holds.
    ///
    /// # Errors
    /// As [`from_listener`](Self::from_listener).
    pub fn from_listener_with(
        listener: TcpListener,
        token: Option<String>,
        limits: ServerLimits,
    ) -> Result<TcpStoreServer> {
        let local_addr = listener.local_addr().map_err(|e| {
            Error::io("cannot read the store server's listening address", e)
                .with_op("store server bind")
        })?;
        let io_err = |what: &str, e| {
            Error::io(
                format!("cannot {what} for the store server on {local_addr}"),
                e,
            )
            .with_op("store server start")
        };
        // The event loop needs a non-blocking listener, whatever mode the
        // caller handed over.
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("configure the listener", e))?;
        let mut listener = mio::net::TcpListener::from_std(listener);
        let poll = mio::Poll::new().map_err(|e| io_err("create an event loop", e))?;
        poll.registry()
            .register(&mut listener, LISTENER, mio::Interest::READABLE)
            .map_err(|e| io_err("watch the listener", e))?;
        let waker = mio::Waker::new(poll.registry(), WAKER)
            .map_err(|e| io_err("create the event loop's waker", e))?;
        let token = token.filter(|t| !t.is_empty());
        if token.is_none() && !local_addr.ip().is_loopback() {
            tracing::warn!(
                addr = %local_addr,
                "the store server listens on {local_addr}, reachable from other machines, \
                 without a run token: anyone who can reach this port can read and change \
                 the rendezvous state; set ACCEL_RUN_TOKEN or bind to 127.0.0.1"
            );
        }
        let shared = Arc::new(Shared {
            store: Arc::new(MemoryStore::new()),
            token,
            local_addr,
            limits,
            stopping: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("accel-store-accept".into())
            .spawn(move || handshake::run(poll, listener, s))
            .map_err(|e| io_err("start the accept thread", e))?;
        tracing::debug!(addr = %local_addr, ?limits, "store server listening");
        Ok(TcpStoreServer {
            shared,
            waker,
            accept: Mutex::new(Some(accept)),
        })
    }

    /// The address the server listens on (the real port when bound to 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    /// The state behind the server, for in-process use by its host (the
    /// launcher) without a round trip. Changes are seen by every client.
    pub fn store(&self) -> &Arc<MemoryStore> {
        &self.shared.store
    }

    /// `tcp://host:port` of this server.
    pub fn url(&self) -> String {
        format!("tcp://{}", self.shared.local_addr)
    }

    /// Stop serving: refuse new connections, close every open one and wake
    /// every blocked request. Idempotent; also done on drop.
    pub fn shutdown(&self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        self.shared.store.wake_waiters();
        let woke = self.waker.wake();
        let handle = self.accept.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            match woke {
                Ok(()) => {
                    let _ = h.join();
                }
                // Joining could block; the loop sees the flag on its next
                // event or deadline.
                Err(e) => tracing::warn!(
                    addr = %self.shared.local_addr,
                    "could not wake the store server's event loop ({e}); leaving it behind"
                ),
            }
        }
        // After the loop is gone no connection can be added.
        for (_, c) in self.shared.conns().drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
        tracing::debug!(addr = %self.shared.local_addr, "store server stopped");
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Serve an authenticated connection on a thread of its own (it is counted
/// against [`ServerLimits::max_connections`] from now on).
pub(crate) fn serve_authenticated(
    shared: &Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    shared.conns().insert(id, stream.try_clone()?);
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("accel-store-conn".into())
        .spawn(move || {
            // `shutdown` sets the flag before draining the table: a
            // connection registered after the drain sees the flag here.
            if !s.stopping.load(Ordering::SeqCst) {
                if let Err(e) = serve_conn(&s, &stream, peer) {
                    tracing::debug!(%peer, "store connection ended: {e}");
                }
            }
            let _ = stream.shutdown(Shutdown::Both);
            s.conns().remove(&id);
        });
    if let Err(e) = spawned {
        shared.conns().remove(&id);
        return Err(e);
    }
    Ok(())
}

/// Constant-time equality: the time depends on `expected`'s length only.
pub(crate) fn token_eq(expected: &[u8], given: &[u8]) -> bool {
    let mut diff = u8::from(expected.len() != given.len());
    for (i, e) in expected.iter().enumerate() {
        let g = given.get(i).copied().unwrap_or(0);
        diff |= std::hint::black_box(e ^ g);
    }
    std::hint::black_box(diff) == 0
}

fn send(mut stream: &TcpStream, resp: &Response) -> io::Result<()> {
    let frame = match resp.encode() {
        Ok(f) => f,
        Err(len) => Response::Error {
            kind: WireErrorKind::InvalidArgument,
            message: format!("the reply would be {len} bytes, above the {MAX_FRAME}-byte limit"),
        }
        .encode()
        .map_err(|_| io::Error::other("cannot encode an error reply"))?,
    };
    write_frame(&mut stream, &frame)
}

fn serve_conn(shared: &Shared, stream: &TcpStream, peer: SocketAddr) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    // Authenticated connections may stay idle for the whole run.
    stream.set_read_timeout(None)?;
    let mut reader = stream;
    send(stream, &Response::Ok)?;

    // --- requests ---
    loop {
        let payload = match read_frame(&mut reader, MAX_FRAME) {
            Ok(p) => p,
            Err(FrameError::Closed) => return Ok(()),
            Err(e @ FrameError::TooLarge { .. }) => {
                tracing::warn!(%peer, "store server closed a connection: {e}");
                // The stream is out of sync: answer, then close.
                let _ = send(
                    stream,
                    &Response::Error {
                        kind: WireErrorKind::Protocol,
                        message: e.to_string(),
                    },
                );
                return Ok(());
            }
            Err(FrameError::Io(e)) => return Err(e),
        };
        let req = match Request::decode(&payload) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%peer, "store server closed a connection after a malformed request: {e}");
                let _ = send(
                    stream,
                    &Response::Error {
                        kind: WireErrorKind::Protocol,
                        message: format!("malformed request: {e}"),
                    },
                );
                return Ok(());
            }
        };
        let Some(resp) = handle(shared, req) else {
            // Shutting down.
            return Ok(());
        };
        send(stream, &resp)?;
    }
}

fn error_response(e: Error) -> Response {
    let kind = match e.kind() {
        ErrorKind::Corrupt => WireErrorKind::Corrupt,
        _ => WireErrorKind::InvalidArgument,
    };
    Response::Error {
        kind,
        message: e.message().to_string(),
    }
}

/// Carry out one request; `None` when the server is shutting down.
fn handle(shared: &Shared, req: Request) -> Option<Response> {
    let store = &shared.store;
    let resp = match req {
        Request::Hello { .. } => Response::Error {
            kind: WireErrorKind::Protocol,
            message: "hello sent twice".into(),
        },
        Request::Set { key, value } => match store.set(&key, &value) {
            Ok(()) => Response::Ok,
            Err(e) => error_response(e),
        },
        Request::Get { key, timeout } => {
            match store.get_or_cancel(&key, timeout, &shared.stopping) {
                Waited::Ready(v) => Response::Value(v),
                Waited::Missing(missing) => Response::Timeout { missing },
                Waited::Cancelled => return None,
            }
        }
        Request::TryGet { key } => match store.try_get(&key) {
            Ok(v) => Response::Maybe(v),
            Err(e) => error_response(e),
        },
        Request::Add { key, delta } => match store.add(&key, delta) {
            Ok(v) => Response::Int(v),
            Err(e) => error_response(e),
        },
        Request::CompareSet {
            key,
            expected,
            desired,
        } => match store.compare_set(&key, expected.as_deref(), &desired) {
            Ok(CasOutcome::Swapped) => Response::Swapped,
            Ok(CasOutcome::Current(v)) => Response::Maybe(v),
            Err(e) => error_response(e),
        },
        Request::Wait { keys, timeout } => {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            match store.wait_or_cancel(&keys, timeout, &shared.stopping) {
                Waited::Ready(()) => Response::Ok,
                Waited::Missing(missing) => Response::Timeout { missing },
                Waited::Cancelled => return None,
            }
        }
        Request::Delete { key } => match store.delete(&key) {
            Ok(b) => Response::Bool(b),
            Err(e) => error_response(e),
        },
    };
    Some(resp)
}
