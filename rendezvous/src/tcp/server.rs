//! The TCP store server: a [`MemoryStore`] behind a socket, one thread per
//! connection.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use accel_api::{CasOutcome, Error, ErrorKind, Result, Store};

use super::wire::{
    read_frame, write_frame, FrameError, Request, Response, WireErrorKind, MAGIC, MAX_FRAME,
    MAX_HELLO_FRAME, PROTOCOL_VERSION,
};
use crate::memory::{MemoryStore, Waited};

/// How long a new connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the server waits for a client to take a reply off the socket.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// The server side of the TCP store, hosted by the launcher (or rank 0).
///
/// Its state is a [`MemoryStore`] (see [`store`](TcpStoreServer::store));
/// each accepted connection is served by its own thread, which is plenty
/// for runs of a few hundred ranks. Blocking `get` / `wait` requests carry
/// their timeout and are answered with the keys still missing when it
/// passes, so no connection is held forever. (A client killed in the middle
/// of a `get` leaves its server thread waiting until that request's timeout;
/// the thread then finds the connection closed and exits.) Authenticated
/// connections may stay idle for the whole run: the server puts no read
/// timeout on them, only a 30 s write timeout on its replies; a new
/// connection must send its hello within 10 s.
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
    accept: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    store: Arc<MemoryStore>,
    token: Option<String>,
    local_addr: SocketAddr,
    stopping: AtomicBool,
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
}

impl Shared {
    fn conns(&self) -> MutexGuard<'_, HashMap<u64, TcpStream>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("TcpStoreServer")
            .field("local_addr", &self.shared.local_addr)
            .field("authenticated", &self.shared.token.is_some())
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
    /// probe-then-bind race.
    ///
    /// # Errors
    /// [`ErrorKind::Io`] when the listener's address cannot be read or the
    /// accept thread cannot be started.
    pub fn from_listener(listener: TcpListener, token: Option<String>) -> Result<TcpStoreServer> {
        let local_addr = listener.local_addr().map_err(|e| {
            Error::io("cannot read the store server's listening address", e)
                .with_op("store server bind")
        })?;
        // The accept loop blocks; make sure a listener handed over in
        // non-blocking mode does not turn it into a spin.
        listener.set_nonblocking(false).map_err(|e| {
            Error::io(
                format!("cannot configure the store listener {local_addr}"),
                e,
            )
        })?;
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
            stopping: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("accel-store-accept".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(|e| Error::io("cannot start the store server's accept thread", e))?;
        tracing::debug!(addr = %local_addr, "store server listening");
        Ok(TcpStoreServer {
            shared,
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
        for (_, c) in self.shared.conns().drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
        // Wake the blocking accept() with a connection of our own.
        let mut wake = self.shared.local_addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake.ip() {
                IpAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
                IpAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
            });
        }
        let woke = TcpStream::connect_timeout(&wake, Duration::from_secs(2)).is_ok();
        let handle = self.accept.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            if woke {
                let _ = h.join();
            } else {
                // Joining could block forever; the thread exits on the next
                // connection attempt instead.
                tracing::warn!(
                    addr = %self.shared.local_addr,
                    "could not wake the store server's accept thread; leaving it behind"
                );
            }
        }
        tracing::debug!(addr = %self.shared.local_addr, "store server stopped");
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match accepted {
            Ok((stream, peer)) => {
                let s = shared.clone();
                let spawned = std::thread::Builder::new()
                    .name("accel-store-conn".into())
                    .spawn(move || serve(&s, stream, peer));
                if let Err(e) = spawned {
                    tracing::warn!(%peer, "store server cannot start a thread for a client: {e}");
                }
            }
            Err(e) => {
                // Out of file descriptors and the like: do not spin.
                tracing::warn!(addr = %shared.local_addr, "store server accept failed: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn serve(shared: &Shared, stream: TcpStream, peer: SocketAddr) {
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    match stream.try_clone() {
        Ok(c) => {
            shared.conns().insert(id, c);
        }
        Err(e) => {
            tracing::warn!(%peer, "store server cannot track a connection: {e}");
            return;
        }
    }
    // `shutdown` sets the flag before draining the table: a connection
    // registered after the drain sees the flag here.
    if !shared.stopping.load(Ordering::SeqCst) {
        if let Err(e) = serve_conn(shared, &stream, peer) {
            tracing::debug!(%peer, "store connection ended: {e}");
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
    shared.conns().remove(&id);
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
    stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let mut reader = stream;

    // --- hello ---
    let hello = match read_frame(&mut reader, MAX_HELLO_FRAME) {
        Ok(p) => Request::decode(&p),
        Err(FrameError::Closed) => return Ok(()),
        Err(e @ FrameError::TooLarge { .. }) => {
            tracing::warn!(%peer, "store server dropped a client that sent a bad hello: {e}");
            return Ok(());
        }
        Err(FrameError::Io(e)) => return Err(e),
    };
    let token = match hello {
        Ok(Request::Hello {
            magic,
            version,
            token,
        }) if magic == MAGIC => {
            if version != PROTOCOL_VERSION {
                tracing::warn!(
                    %peer,
                    "store server refused a client speaking protocol version {version} \
                     (this server speaks {PROTOCOL_VERSION})"
                );
                let _ = send(
                    stream,
                    &Response::VersionMismatch {
                        server_version: PROTOCOL_VERSION,
                    },
                );
                return Ok(());
            }
            token
        }
        _ => {
            tracing::warn!(
                %peer,
                "store server dropped a client that is not an accel store client (bad hello)"
            );
            return Ok(());
        }
    };
    if let Some(expected) = &shared.token {
        let refusal = match token.as_deref().filter(|t| !t.is_empty()) {
            None => Some("the client presented no run token"),
            Some(t) if !token_eq(expected.as_bytes(), t.as_bytes()) => {
                Some("the client's run token does not match the server's")
            }
            Some(_) => None,
        };
        if let Some(why) = refusal {
            tracing::warn!(
                %peer,
                server = %shared.local_addr,
                "store server refused a connection from {peer}: {why}"
            );
            let _ = send(
                stream,
                &Response::Refused {
                    message: why.to_string(),
                },
            );
            return Ok(());
        }
    }
    send(stream, &Response::Ok)?;
    // Authenticated connections may stay idle for the whole run.
    stream.set_read_timeout(None)?;

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
