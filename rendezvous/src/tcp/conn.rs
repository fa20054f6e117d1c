//! What the store server's threads share ([`Shared`]: the store, the
//! token, the [`ServerLimits`], the served connections) and the serving of
//! one authenticated connection, on its own thread: read a request, carry
//! it out on the [`MemoryStore`], answer. Below both the event loop that
//! authenticates connections (`handshake`) and the server that owns them
//! (`server`).

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use accel_api::{CasOutcome, Error, ErrorKind, Store};

use super::wire::{
    read_frame, write_frame, FrameError, Request, Response, WireErrorKind, MAX_FRAME,
};
use crate::memory::{MemoryStore, Waited};

/// How long the server waits for a client to take a reply off the socket.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Bounds on what a [`TcpStoreServer`](super::TcpStoreServer) holds for its
/// clients. The defaults suit runs of thousands of ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Authenticated connections served at once (default 4096); each has a
    /// thread. A client past the cap is answered "busy" and retries until
    /// its connect timeout.
    pub max_connections: usize,
    /// Connections still sending their hello at once (default 512); when
    /// full, the oldest is dropped to make room for the newest.
    pub max_handshakes: usize,
    /// How long a new connection has, from its accept, to send its whole
    /// hello (default 10 s).
    pub handshake_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> ServerLimits {
        ServerLimits {
            max_connections: 4096,
            max_handshakes: 512,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

pub(crate) struct Shared {
    pub(crate) store: Arc<MemoryStore>,
    pub(crate) token: Option<String>,
    pub(crate) local_addr: SocketAddr,
    pub(crate) limits: ServerLimits,
    pub(crate) stopping: AtomicBool,
    /// Authenticated connections being served (clones, to shut them down).
    pub(crate) conns: Mutex<HashMap<u64, TcpStream>>,
    pub(crate) next_conn: AtomicU64,
}

impl Shared {
    pub(crate) fn conns(&self) -> MutexGuard<'_, HashMap<u64, TcpStream>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
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
