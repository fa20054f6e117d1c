//! The TCP store server: a [`MemoryStore`] behind a socket. New
//! connections wait for their hello in one event loop
//! ([`handshake`](super::handshake)); each authenticated connection is then
//! served by its own thread.

use std::collections::HashMap;
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use accel_api::{Error, Result};

use super::conn::{ServerLimits, Shared};
use super::handshake::{self, LISTENER, WAKER};
use crate::memory::MemoryStore;

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
    /// [`ErrorKind::Io`](accel_api::ErrorKind::Io) naming `addr` when it cannot be bound (in use, not
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
    /// [`ErrorKind::Io`](accel_api::ErrorKind::Io) when the listener's address cannot be read or the
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
