//! A server of torch's TCPStore protocol: one event-loop thread serves every
//! connection (as torch's libuv server does), so thousands of idle or slow
//! clients cost sockets and buffers, not threads.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use accel_api::{Error, Result};
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token, Waker};

use super::wire::{self, parse, Parsed, Request};

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const FIRST_CONN: usize = 2;

/// The bounds a [`TorchStoreServer`] holds its clients to.
#[derive(Debug, Clone)]
pub struct TorchServerLimits {
    /// A new connection must send its validation within this (10 s).
    pub validate_timeout: Duration,
    /// A request that has started arriving must be complete within this
    /// (30 s): a client trickling bytes is closed.
    pub request_timeout: Duration,
    /// At most this many connections are served (4096); more are closed
    /// at once.
    pub max_connections: usize,
    /// Replies a client has not taken off the socket, at most (64 MiB).
    pub max_unsent: usize,
}

impl Default for TorchServerLimits {
    fn default() -> Self {
        TorchServerLimits {
            validate_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connections: 4096,
            max_unsent: 64 << 20,
        }
    }
}

/// A server of torch's TCPStore protocol (torch 2.13, libuv flavour): what
/// `torch.distributed.TCPStore(is_master=True)` and torchrun's agent host.
///
/// torch clients (`TCPStore(host, port, is_master=False)`,
/// `init_process_group("gloo")` with `env://`) and [`TorchStore`](super::TorchStore)
/// talk to it alike. Every operation of the protocol is served: set, get,
/// add, compare_set, check, wait (with cancel), num_keys, delete, append,
/// multi_get, multi_set, ping, the queues, list_keys and barrier.
///
/// # Admission
///
/// The protocol has no authentication. The server admits a connection only
/// once its first request is a validation with torch's magic number, sent
/// within [`TorchServerLimits::validate_timeout`]; anything else (an HTTP
/// probe, accel's own protocol, random bytes) is closed and logged. Keys
/// and values are bounded as torch bounds them (8 KiB keys, 8 MiB values,
/// 128 Ki keys per request), requests must complete within
/// `request_timeout`, unsent replies are capped. Who may connect at all is
/// decided by where the listener is bound: see docs/adr for the policy.
///
/// # Shutdown
///
/// [`shutdown`](Self::shutdown) (or dropping the server) closes every
/// connection, so blocked clients fail at once.
pub struct TorchStoreServer {
    local_addr: SocketAddr,
    stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for TorchStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchStoreServer")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

impl TorchStoreServer {
    /// Serve on `addr` (port 0: a free port).
    ///
    /// # Errors
    /// [`ErrorKind::Io`](accel_api::ErrorKind::Io) when the address cannot
    /// be bound.
    pub fn bind(addr: SocketAddr) -> Result<TorchStoreServer> {
        let l = TcpListener::bind(addr)
            .map_err(|e| Error::io(format!("torch store: binding {addr}"), e))?;
        TorchStoreServer::from_listener(l, TorchServerLimits::default())
    }

    /// Serve on a listener bound beforehand (no probe-then-bind race).
    ///
    /// # Errors
    /// [`ErrorKind::Io`](accel_api::ErrorKind::Io) when the listener cannot
    /// be registered with the event loop.
    pub fn from_listener(l: TcpListener, limits: TorchServerLimits) -> Result<TorchStoreServer> {
        let io = |what: &str, e: io::Error| Error::io(format!("torch store: {what}"), e);
        let local_addr = l.local_addr().map_err(|e| io("listener address", e))?;
        l.set_nonblocking(true)
            .map_err(|e| io("non-blocking listener", e))?;
        let mut listener = mio::net::TcpListener::from_std(l);
        let poll = Poll::new().map_err(|e| io("event loop", e))?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| io("registering the listener", e))?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER).map_err(|e| io("waker", e))?);
        let stop = Arc::new(AtomicBool::new(false));
        let mut lp = Loop {
            poll,
            listener,
            limits,
            conns: HashMap::new(),
            next: FIRST_CONN,
            state: State::default(),
            stop: stop.clone(),
            refused_logged: 0,
        };
        let thread = std::thread::Builder::new()
            .name("accel-torch-store".into())
            .spawn(move || lp.run())
            .map_err(|e| io("starting the server thread", e))?;
        tracing::debug!(%local_addr, "torch store server listening");
        Ok(TorchStoreServer {
            local_addr,
            stop,
            waker,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// `torch://host:port`, what [`open_store`](crate::open_store) takes.
    pub fn url(&self) -> String {
        format!("torch://{}", self.local_addr)
    }

    /// Stop serving and close every connection. Idempotent.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.waker.wake();
        let t = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }
}

impl Drop for TorchStoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

type ConnId = usize;

/// The store itself, and who waits for what.
#[derive(Default)]
struct State {
    kv: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Key -> connections waiting for it (once per awaited key).
    waiting: HashMap<Vec<u8>, Vec<ConnId>>,
    /// Connection -> how many of its awaited keys are still missing.
    awaited: HashMap<ConnId, usize>,
}

/// Replies to send, to whichever connection.
type Out = Vec<(ConnId, Vec<u8>)>;

fn int_of(v: &[u8]) -> Option<i64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

impl State {
    fn ready(&self, key: &[u8]) -> bool {
        self.kv.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Wake the waiters of `key`: all of them, or (a queue push) the first
    /// whose last awaited key this was.
    fn wake(&mut self, key: &[u8], only_one: bool, out: &mut Out) {
        let Some(list) = self.waiting.get_mut(key) else {
            return;
        };
        let mut woken = Vec::new();
        if only_one {
            if let Some(pos) = list.iter().position(|id| self.awaited.get(id) == Some(&1)) {
                woken.push(list.remove(pos));
            }
        } else {
            woken = std::mem::take(list);
        }
        if list.is_empty() {
            self.waiting.remove(key);
        }
        for id in woken {
            if let Some(n) = self.awaited.get_mut(&id) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.awaited.remove(&id);
                    out.push((id, vec![wire::STOP_WAITING]));
                }
            }
        }
    }

    fn forget(&mut self, id: ConnId) {
        if self.awaited.remove(&id).is_some() {
            self.waiting.retain(|_, l| {
                l.retain(|c| *c != id);
                !l.is_empty()
            });
        }
    }

    /// Serve one request of connection `id`. `Err` closes the connection,
    /// as torch's server does when a request cannot be served.
    fn serve(
        &mut self,
        id: ConnId,
        req: Request,
        out: &mut Out,
    ) -> std::result::Result<(), String> {
        let mut reply = Vec::new();
        match req {
            Request::Validate(_) => return Err("a second validation".into()),
            Request::Set(k, v) => {
                self.kv.insert(k.clone(), v);
                self.wake(&k, false, out);
            }
            Request::CompareSet(k, expected, desired) => {
                let now = match self.kv.get_mut(&k) {
                    None if expected.is_empty() => {
                        self.kv.insert(k.clone(), desired.clone());
                        desired
                    }
                    // torch's server answers `expected` for an absent key.
                    None => expected,
                    Some(cur) => {
                        if *cur == expected {
                            *cur = desired;
                        }
                        cur.clone()
                    }
                };
                wire::value_reply(&mut reply, &now);
                self.wake(&k, false, out);
            }
            Request::Get(k) => {
                wire::value_reply(&mut reply, self.kv.get(&k).map_or(&[][..], |v| v))
            }
            Request::Add(k, delta) => {
                let cur = match self.kv.get(&k) {
                    None => 0,
                    Some(v) => int_of(v).ok_or_else(|| {
                        format!(
                            "add to key {:?}, which holds no integer",
                            String::from_utf8_lossy(&k)
                        )
                    })?,
                };
                let new = cur.checked_add(delta).ok_or_else(|| {
                    format!(
                        "add {delta} to key {:?} overflows",
                        String::from_utf8_lossy(&k)
                    )
                })?;
                self.kv.insert(k.clone(), new.to_string().into_bytes());
                reply.extend_from_slice(&new.to_le_bytes());
                self.wake(&k, false, out);
            }
            Request::Check(keys) => {
                let all = keys.iter().all(|k| self.ready(k));
                reply.push(if all { wire::READY } else { wire::NOT_READY });
            }
            Request::Wait(keys) => {
                if keys.iter().all(|k| self.ready(k)) {
                    reply.push(wire::STOP_WAITING);
                } else {
                    self.forget(id);
                    let missing: Vec<_> = keys
                        .into_iter()
                        .filter(|k| !self.kv.contains_key(k))
                        .collect();
                    self.awaited.insert(id, missing.len());
                    for k in missing {
                        self.waiting.entry(k).or_default().push(id);
                    }
                }
            }
            Request::NumKeys => reply.extend_from_slice(&(self.kv.len() as i64).to_le_bytes()),
            Request::Delete(k) => {
                let n = i64::from(self.kv.remove(&k).is_some());
                reply.extend_from_slice(&n.to_le_bytes());
            }
            Request::Append(k, v) => {
                self.kv.entry(k.clone()).or_default().extend_from_slice(&v);
                self.wake(&k, false, out);
            }
            Request::MultiGet(keys) => {
                for k in keys {
                    wire::value_reply(&mut reply, self.kv.get(&k).map_or(&[][..], |v| v));
                }
            }
            Request::MultiSet(pairs) => {
                for (k, v) in pairs {
                    self.kv.insert(k.clone(), v);
                    self.wake(&k, false, out);
                }
            }
            Request::CancelWait => {
                self.forget(id);
                reply.push(wire::WAIT_CANCELED);
            }
            Request::Ping(n) => reply.extend_from_slice(&n.to_le_bytes()),
            Request::QueuePush(k, v) => {
                self.queues.entry(k.clone()).or_default().push_back(v);
                self.wake(&k, true, out);
            }
            Request::QueuePop(k) => {
                let q = self.queues.entry(k).or_default();
                reply.extend_from_slice(&(q.len() as i64).to_le_bytes());
                if let Some(v) = q.pop_front() {
                    wire::value_reply(&mut reply, &v);
                }
            }
            Request::QueueLen(k) => {
                let n = self.queues.get(&k).map_or(0, VecDeque::len) as i64;
                reply.extend_from_slice(&n.to_le_bytes());
            }
            Request::ListKeys => {
                reply.extend_from_slice(&(self.kv.len() as i64).to_le_bytes());
                for k in self.kv.keys() {
                    wire::value_reply(&mut reply, k);
                }
            }
            Request::Barrier(k, world) => {
                let count = match self.kv.get(&k) {
                    None => 1,
                    Some(v) => int_of(v).and_then(|c| c.checked_add(1)).ok_or_else(|| {
                        format!(
                            "barrier on key {:?}, which holds no counter",
                            String::from_utf8_lossy(&k)
                        )
                    })?,
                };
                self.kv.insert(k.clone(), count.to_string().into_bytes());
                if count >= world {
                    self.wake(&k, false, out);
                    reply.push(wire::STOP_WAITING);
                } else {
                    self.forget(id);
                    self.awaited.insert(id, 1);
                    self.waiting.entry(k).or_default().push(id);
                }
            }
        }
        if !reply.is_empty() {
            out.push((id, reply));
        }
        Ok(())
    }
}

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    validated: bool,
    opened: Instant,
    /// When the request now in `rbuf` started arriving.
    partial_since: Option<Instant>,
    writable_interest: bool,
}

struct Loop {
    poll: Poll,
    listener: mio::net::TcpListener,
    limits: TorchServerLimits,
    conns: HashMap<ConnId, Conn>,
    next: ConnId,
    state: State,
    stop: Arc<AtomicBool>,
    refused_logged: u32,
}

/// The most a request (and so the read buffer) may take: a multi_set of
/// the largest keys and values is refused by `parse` long before this.
const MAX_BUFFERED: usize = 64 << 20;

impl Loop {
    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        let mut last_sweep = Instant::now();
        while !self.stop.load(Ordering::SeqCst) {
            if let Err(e) = self
                .poll
                .poll(&mut events, Some(Duration::from_millis(200)))
            {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!(error = %e, "torch store: event loop failed; closing");
                break;
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept(),
                    WAKER => {}
                    Token(id) => {
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.read(id);
                        }
                        if ev.is_writable() {
                            self.flush(id);
                        }
                    }
                }
            }
            if last_sweep.elapsed() >= Duration::from_millis(200) {
                self.sweep();
                last_sweep = Instant::now();
            }
        }
        let ids: Vec<_> = self.conns.keys().copied().collect();
        for id in ids {
            self.close(id, None);
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, peer)) => {
                    if self.conns.len() >= self.limits.max_connections {
                        if self.refused_logged < 5 {
                            self.refused_logged += 1;
                            tracing::warn!(%peer, max = self.limits.max_connections, "torch store: too many connections; closing a new one");
                        }
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let id = self.next;
                    self.next += 1;
                    if self
                        .poll
                        .registry()
                        .register(&mut stream, Token(id), Interest::READABLE)
                        .is_err()
                    {
                        continue;
                    }
                    self.conns.insert(
                        id,
                        Conn {
                            stream,
                            peer,
                            rbuf: Vec::new(),
                            wbuf: Vec::new(),
                            validated: false,
                            opened: Instant::now(),
                            partial_since: None,
                            writable_interest: false,
                        },
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!(error = %e, "torch store: accept failed");
                    return;
                }
            }
        }
    }

    fn read(&mut self, id: ConnId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let mut chunk = [0u8; 64 * 1024];
        let mut eof = false;
        loop {
            match c.stream.read(&mut chunk) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    c.rbuf.extend_from_slice(&chunk[..n]);
                    if c.rbuf.len() > MAX_BUFFERED {
                        self.close(id, Some("a request larger than the server reads".into()));
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    eof = true;
                    break;
                }
            }
        }
        self.process(id);
        if eof {
            self.close(id, None);
        }
    }

    fn process(&mut self, id: ConnId) {
        let mut out = Out::new();
        loop {
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            if c.rbuf.is_empty() {
                c.partial_since = None;
                break;
            }
            match parse(&c.rbuf) {
                Parsed::Incomplete => {
                    c.partial_since.get_or_insert_with(Instant::now);
                    break;
                }
                Parsed::Bad(why) => {
                    let why = if c.validated {
                        why
                    } else {
                        format!("not a torch TCPStore client ({why})")
                    };
                    self.close(id, Some(why));
                    break;
                }
                Parsed::Done(req, used) => {
                    c.rbuf.drain(..used);
                    c.partial_since = None;
                    if !c.validated {
                        match req {
                            Request::Validate(wire::MAGIC) => c.validated = true,
                            _ => {
                                self.close(
                                    id,
                                    Some(
                                        "not a torch TCPStore client (no validation first)".into(),
                                    ),
                                );
                                break;
                            }
                        }
                        continue;
                    }
                    if let Err(why) = self.state.serve(id, req, &mut out) {
                        self.close(id, Some(why));
                        break;
                    }
                }
            }
        }
        for (to, bytes) in out {
            if let Some(c) = self.conns.get_mut(&to) {
                c.wbuf.extend_from_slice(&bytes);
                self.flush(to);
            }
        }
    }

    fn flush(&mut self, id: ConnId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        while !c.wbuf.is_empty() {
            match c.stream.write(&c.wbuf) {
                Ok(0) => break,
                Ok(n) => {
                    c.wbuf.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close(id, None);
                    return;
                }
            }
        }
        if c.wbuf.len() > self.limits.max_unsent {
            self.close(id, Some("a client that does not read its replies".into()));
            return;
        }
        let want = !c.wbuf.is_empty();
        if want != c.writable_interest {
            let interest = if want {
                Interest::READABLE | Interest::WRITABLE
            } else {
                Interest::READABLE
            };
            if self
                .poll
                .registry()
                .reregister(&mut c.stream, Token(id), interest)
                .is_ok()
            {
                c.writable_interest = want;
            }
        }
    }

    fn sweep(&mut self) {
        let now = Instant::now();
        let late: Vec<(ConnId, &'static str)> = self
            .conns
            .iter()
            .filter_map(|(id, c)| {
                if !c.validated && now.duration_since(c.opened) > self.limits.validate_timeout {
                    Some((*id, "no validation in time"))
                } else if c
                    .partial_since
                    .is_some_and(|t| now.duration_since(t) > self.limits.request_timeout)
                {
                    Some((*id, "a request that did not complete in time"))
                } else {
                    None
                }
            })
            .collect();
        for (id, why) in late {
            self.close(id, Some(why.into()));
        }
        self.refused_logged = 0;
    }

    fn close(&mut self, id: ConnId, why: Option<String>) {
        if let Some(mut c) = self.conns.remove(&id) {
            if let Some(why) = why {
                tracing::warn!(peer = %c.peer, "torch store: closing a connection: {why}");
            }
            let _ = self.poll.registry().deregister(&mut c.stream);
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        self.state.forget(id);
    }
}
