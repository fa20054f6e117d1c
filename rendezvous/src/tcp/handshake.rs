//! The store server's front door: one thread, one `mio` event loop, that
//! accepts connections and reads their hello without a thread per
//! connection.
//!
//! A new connection is held here, non-blocking, until its hello frame is
//! complete. Three bounds make a flood of slow or silent connections cheap
//! (issue 22, item 6):
//!
//! * a **whole-handshake deadline**: the hello must be complete
//!   [`ServerLimits::handshake_timeout`] after the accept, however the bytes
//!   trickle in (not a per-read timeout, which a client sending one byte at
//!   a time resets forever);
//! * a **cap on connections in their hello**
//!   ([`ServerLimits::max_handshakes`]): when full, the *oldest* is dropped
//!   to make room, so a flood cannot lock real clients out (a real client
//!   sends its hello as soon as it is connected, well before the flood
//!   catches up with it); the same happens when accepting fails for want of
//!   file descriptors;
//! * a **cap on served connections** ([`ServerLimits::max_connections`]):
//!   each authenticated connection gets a thread (blocking `get` / `wait`
//!   requests park there); past the cap a client is answered `Busy`, which
//!   it retries until its timeout.
//!
//! Refusals are logged through a [`RejectLog`]: the first few of each
//! 10-second window one by one, then one summary line with the count, so a
//! flood cannot flood the launcher's log.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::{TcpListener as MioListener, TcpStream as MioStream};
use mio::{Events, Interest, Poll, Token};

use super::conn::{serve_authenticated, token_eq, ServerLimits, Shared};
use super::wire::{Request, Response, MAGIC, MAX_HELLO_FRAME, PROTOCOL_VERSION};

pub(crate) const LISTENER: Token = Token(usize::MAX);
pub(crate) const WAKER: Token = Token(usize::MAX - 1);

/// Accepts per loop turn before pending reads get their turn.
const ACCEPT_BATCH: usize = 256;
/// Pause before accepting again after an accept error with nothing to evict.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);
/// The logging window of [`RejectLog`] and the lines it shows one by one.
const LOG_WINDOW: Duration = Duration::from_secs(10);
const LOG_BURST: u32 = 5;

/// Why a connection was turned away, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reject {
    BadHello,
    Version(u16),
    NoToken,
    WrongToken,
    Slow,
    Evicted,
    Busy,
}

impl Reject {
    fn describe(self, limits: &ServerLimits) -> String {
        match self {
            Reject::BadHello => "it is not an accel store client (bad hello)".into(),
            Reject::Version(v) => {
                format!("it speaks protocol version {v} (this server speaks {PROTOCOL_VERSION})")
            }
            Reject::NoToken => "the client presented no run token".into(),
            Reject::WrongToken => "the client's run token does not match the server's".into(),
            Reject::Slow => format!(
                "it did not complete its hello within {:?}",
                limits.handshake_timeout
            ),
            Reject::Evicted => format!(
                "{} connections were already waiting for their hello (the oldest is dropped)",
                limits.max_handshakes
            ),
            Reject::Busy => format!(
                "the server already serves {} connections",
                limits.max_connections
            ),
        }
    }
}

/// Rate-limited warnings about refused and dropped connections.
pub(crate) struct RejectLog {
    server: SocketAddr,
    window: Instant,
    shown: u32,
    suppressed: u64,
    last: Option<String>,
}

impl RejectLog {
    pub(crate) fn new(server: SocketAddr) -> RejectLog {
        RejectLog {
            server,
            window: Instant::now(),
            shown: 0,
            suppressed: 0,
            last: None,
        }
    }

    /// Log `what` (about `peer`) now, or count it for the window's summary.
    pub(crate) fn warn(&mut self, peer: Option<SocketAddr>, what: &str) {
        self.roll(Instant::now());
        if self.shown < LOG_BURST {
            self.shown += 1;
            match peer {
                Some(peer) => tracing::warn!(%peer, server = %self.server, "{what}"),
                None => tracing::warn!(server = %self.server, "{what}"),
            }
        } else {
            self.suppressed += 1;
            self.last = Some(match peer {
                Some(p) => format!("{p}: {what}"),
                None => what.to_string(),
            });
        }
    }

    /// Start a new window when the current one is over, summarising it.
    fn roll(&mut self, now: Instant) {
        if now.duration_since(self.window) < LOG_WINDOW {
            return;
        }
        self.flush();
        self.window = now;
        self.shown = 0;
    }

    fn flush(&mut self) {
        if self.suppressed > 0 {
            tracing::warn!(
                server = %self.server,
                suppressed = self.suppressed,
                "store server: {} more connections were refused or dropped in the last {:?} \
                 (not logged one by one; the last: {})",
                self.suppressed,
                LOG_WINDOW,
                self.last.take().unwrap_or_default()
            );
            self.suppressed = 0;
        }
    }

    /// When the loop must wake to print the summary, if one is owed.
    fn due_in(&self, now: Instant) -> Option<Duration> {
        (self.suppressed > 0).then(|| (self.window + LOG_WINDOW).saturating_duration_since(now))
    }
}

impl Drop for RejectLog {
    fn drop(&mut self) {
        self.flush();
    }
}

/// A connection still in its hello.
struct Pending {
    stream: MioStream,
    peer: SocketAddr,
    deadline: Instant,
    /// The frame so far: the 4-byte length, then the payload.
    buf: Vec<u8>,
}

enum Step {
    /// Wait for more bytes.
    Wait,
    /// The whole hello payload is there.
    Complete(Vec<u8>),
    /// Closed before finishing (`true` when it had sent nothing at all).
    Closed(bool),
    /// The announced hello is larger than [`MAX_HELLO_FRAME`].
    TooLarge(u32),
    Failed(io::Error),
}

impl Pending {
    /// Read what has arrived, never past the hello frame (later bytes are
    /// requests, for the connection's thread).
    fn advance(&mut self) -> Step {
        let mut chunk = [0u8; 4096];
        loop {
            let missing = if self.buf.len() < 4 {
                4 - self.buf.len()
            } else {
                let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]);
                if len > MAX_HELLO_FRAME {
                    return Step::TooLarge(len);
                }
                let want = 4 + len as usize;
                if self.buf.len() == want {
                    return Step::Complete(self.buf.split_off(4));
                }
                want - self.buf.len()
            };
            let n = missing.min(chunk.len());
            match self.stream.read(&mut chunk[..n]) {
                Ok(0) => return Step::Closed(self.buf.is_empty()),
                Ok(k) => self.buf.extend_from_slice(&chunk[..k]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Wait,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Step::Failed(e),
            }
        }
    }
}

/// The event loop; returns when the server stops.
pub(crate) fn run(mut poll: Poll, mut listener: MioListener, shared: Arc<Shared>) {
    let limits = shared.limits;
    let mut events = Events::with_capacity(1024);
    let mut pending: BTreeMap<u64, Pending> = BTreeMap::new();
    let mut next_id: u64 = 0;
    let mut log = RejectLog::new(shared.local_addr);
    // `Some(d)`: accept again `d` from now without waiting for an event
    // (the listener is edge-triggered; a batch cut short must be resumed).
    let mut accept_again: Option<Instant> = Some(Instant::now());
    loop {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let now = Instant::now();
        if accept_again.is_some_and(|t| t <= now) {
            accept_again = accept_batch(
                &poll,
                &mut listener,
                &shared,
                &mut pending,
                &mut next_id,
                &mut log,
            );
        }
        let now = Instant::now();
        let mut timeout = pending
            .first_key_value()
            .map(|(_, p)| p.deadline.saturating_duration_since(now));
        for t in [
            accept_again.map(|t| t.saturating_duration_since(now)),
            log.due_in(now),
        ]
        .into_iter()
        .flatten()
        {
            timeout = Some(timeout.map_or(t, |x| x.min(t)));
        }
        if let Err(e) = poll.poll(&mut events, timeout) {
            if e.kind() != io::ErrorKind::Interrupted {
                log.warn(None, &format!("store server event loop: poll failed: {e}"));
                std::thread::sleep(ACCEPT_BACKOFF);
            }
            continue;
        }
        for ev in events.iter() {
            match ev.token() {
                LISTENER => accept_again = Some(Instant::now()),
                WAKER => {}
                Token(id) => {
                    let id = id as u64;
                    let step = match pending.get_mut(&id) {
                        Some(p) => p.advance(),
                        None => continue,
                    };
                    if matches!(step, Step::Wait) {
                        continue;
                    }
                    if let Some(p) = pending.remove(&id) {
                        finish(&poll, &shared, p, step, &mut log);
                    }
                }
            }
        }
        // The whole-handshake deadline: ids grow with accept time, so the
        // first entries are the oldest.
        let now = Instant::now();
        while let Some(oldest) = pending.first_entry() {
            if oldest.get().deadline > now {
                break;
            }
            let mut p = oldest.remove();
            let _ = poll.registry().deregister(&mut p.stream);
            log.warn(
                Some(p.peer),
                &format!(
                    "store server dropped a connection: {}",
                    Reject::Slow.describe(&limits)
                ),
            );
        }
        log.roll(now);
    }
}

/// Accept up to [`ACCEPT_BATCH`] connections; when to accept again without
/// an event (`None`: wait for one).
fn accept_batch(
    poll: &Poll,
    listener: &mut MioListener,
    shared: &Shared,
    pending: &mut BTreeMap<u64, Pending>,
    next_id: &mut u64,
    log: &mut RejectLog,
) -> Option<Instant> {
    let limits = shared.limits;
    for _ in 0..ACCEPT_BATCH {
        match listener.accept() {
            Ok((mut stream, peer)) => {
                if pending.len() >= limits.max_handshakes.max(1) {
                    evict_oldest(poll, pending, log, &limits);
                }
                let id = *next_id;
                *next_id += 1;
                // Below the listener's and the waker's tokens (ids never get
                // near 2^64 - 2 on 64-bit targets).
                let token = Token((id % WAKER.0 as u64) as usize);
                if let Err(e) = poll
                    .registry()
                    .register(&mut stream, token, Interest::READABLE)
                {
                    log.warn(
                        Some(peer),
                        &format!("store server cannot watch a connection: {e}"),
                    );
                    continue;
                }
                pending.insert(
                    id,
                    Pending {
                        stream,
                        peer,
                        deadline: Instant::now() + limits.handshake_timeout,
                        buf: Vec::new(),
                    },
                );
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of file descriptors, most likely: free one by dropping
                // the oldest connection still in its hello, and go on.
                if !pending.is_empty() {
                    evict_oldest(poll, pending, log, &limits);
                    continue;
                }
                log.warn(None, &format!("store server accept failed: {e}"));
                return Some(Instant::now() + ACCEPT_BACKOFF);
            }
        }
    }
    // Cut short: resume right after serving what is readable.
    Some(Instant::now())
}

fn evict_oldest(
    poll: &Poll,
    pending: &mut BTreeMap<u64, Pending>,
    log: &mut RejectLog,
    limits: &ServerLimits,
) {
    if let Some((_, mut p)) = pending.pop_first() {
        let _ = poll.registry().deregister(&mut p.stream);
        log.warn(
            Some(p.peer),
            &format!(
                "store server dropped a connection: {}",
                Reject::Evicted.describe(limits)
            ),
        );
    }
}

/// Best effort: a small reply into an empty socket buffer does not block.
fn reply(stream: &mut MioStream, resp: &Response) {
    if let Ok(frame) = resp.encode() {
        let _ = stream.write(&frame);
    }
}

/// A connection's hello is over: refuse it, or hand it to its thread.
fn finish(poll: &Poll, shared: &Arc<Shared>, mut p: Pending, step: Step, log: &mut RejectLog) {
    let limits = shared.limits;
    let _ = poll.registry().deregister(&mut p.stream);
    let refuse = |log: &mut RejectLog, why: Reject| {
        log.warn(
            Some(p.peer),
            &format!(
                "store server refused a connection from {}: {}",
                p.peer,
                why.describe(&limits)
            ),
        );
    };
    let payload = match step {
        // Never passed in: the caller keeps connections that still wait.
        Step::Wait => return,
        Step::Complete(payload) => payload,
        Step::Closed(true) => {
            // A port probe or a health check: nothing to report.
            tracing::debug!(peer = %p.peer, "store connection closed before its hello");
            return;
        }
        Step::Closed(false) => {
            tracing::debug!(peer = %p.peer, "store connection closed during its hello");
            return;
        }
        Step::Failed(e) => {
            tracing::debug!(peer = %p.peer, "store connection lost during its hello: {e}");
            return;
        }
        Step::TooLarge(len) => {
            log.warn(
                Some(p.peer),
                &format!(
                    "store server dropped a client that sent a bad hello: a {len}-byte frame \
                     (the limit is {MAX_HELLO_FRAME})"
                ),
            );
            return;
        }
    };
    let token = match Request::decode(&payload) {
        Ok(Request::Hello {
            magic,
            version,
            token,
        }) if magic == MAGIC => {
            if version != PROTOCOL_VERSION {
                refuse(log, Reject::Version(version));
                reply(
                    &mut p.stream,
                    &Response::VersionMismatch {
                        server_version: PROTOCOL_VERSION,
                    },
                );
                return;
            }
            token
        }
        _ => {
            refuse(log, Reject::BadHello);
            return;
        }
    };
    if let Some(expected) = &shared.token {
        let why = match token.as_deref().filter(|t| !t.is_empty()) {
            None => Some(Reject::NoToken),
            Some(t) if !token_eq(expected.as_bytes(), t.as_bytes()) => Some(Reject::WrongToken),
            Some(_) => None,
        };
        if let Some(why) = why {
            refuse(log, why);
            reply(
                &mut p.stream,
                &Response::Refused {
                    message: why.describe(&limits),
                },
            );
            return;
        }
    }
    let served = shared.conns().len();
    if served >= limits.max_connections {
        refuse(log, Reject::Busy);
        reply(
            &mut p.stream,
            &Response::Busy {
                message: format!(
                    "{} serves {served} connections, its limit; retry later or raise the limit",
                    shared.local_addr
                ),
            },
        );
        return;
    }
    let stream: TcpStream = p.stream.into();
    if let Err(e) = serve_authenticated(shared, stream, p.peer) {
        log.warn(
            Some(p.peer),
            &format!("store server cannot serve a connection: {e}"),
        );
    }
}
