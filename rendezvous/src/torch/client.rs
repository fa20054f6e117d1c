//! A client of torch's TCPStore protocol behind accel's [`Store`] trait.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use accel_api::{CasOutcome, Error, ErrorKind, Result, Store};

use super::wire::{self, q, Msg};
use crate::memory::missing_keys_error;
use accel_api::sync::lock;

/// Every key goes over the wire under this prefix, as torch's own client
/// sends them, so that torch programs and accel see the same keys.
const KEY_PREFIX: &str = "/";
const CONNECT_ATTEMPT: Duration = Duration::from_secs(5);
const POOL_MAX: usize = 4;
const FIX_SERVER: &str = "check that the process hosting the torch store (torchrun's agent, \
                          rank 0, or accel launch) is running and reachable at that address";

/// A client of a torch TCPStore server: torchrun's agent store, a
/// `torch.distributed.TCPStore(is_master=True)`, or accel's own
/// [`TorchStoreServer`](super::TorchStoreServer).
///
/// Keys are sent with torch's `/` prefix, so `set("k")` here is
/// `store.get("k")` for a Python client of the same server.
///
/// # Connections and timeouts
///
/// [`connect`](Self::connect) retries until `timeout` (the server may start
/// after its clients, as under torchrun), then validates and pings.
/// Non-blocking requests share one control connection; `get`, `wait`,
/// `barrier` and blocking queue pops each take a pooled connection of their
/// own, after a ping on the control connection so that they see every write
/// this client made before. Every socket read and write is bounded, by the
/// request's own timeout for a wait (then the wait is cancelled as torch's
/// client cancels it) and by the client's `timeout` otherwise. A connection
/// that saw an error is dropped and the next call opens a new one.
///
/// # Where torch's protocol differs from accel's store
/// * An absent key and an empty value look the same to `get` on the wire;
///   `try_get` checks first, so it tells them apart.
/// * `compare_set` with `Some(b"")` expected means "absent", as in torch.
/// * torch's server closes the connection when `add` meets a value that is
///   not an integer; this client then reports [`ErrorKind::Corrupt`] naming
///   the key.
pub struct TorchStore {
    addr: String,
    timeout: Duration,
    control: Mutex<Option<TcpStream>>,
    /// Fire-and-forget writes sent on the control connection since its last
    /// reply: a ping settles them before a pooled connection is used.
    unsettled: AtomicBool,
    pool: Mutex<Vec<TcpStream>>,
}

impl fmt::Debug for TorchStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TorchStore")
            .field("addr", &self.addr)
            .finish()
    }
}

fn prefixed(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.extend_from_slice(KEY_PREFIX.as_bytes());
    k.extend_from_slice(key.as_bytes());
    k
}

/// What went wrong on one connection.
enum Fail {
    Io(io::Error),
    Closed,
}

impl From<io::Error> for Fail {
    fn from(e: io::Error) -> Fail {
        if matches!(
            e.kind(),
            io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe
        ) {
            Fail::Closed
        } else {
            Fail::Io(e)
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn read_u8(s: &mut TcpStream) -> std::result::Result<u8, Fail> {
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_i64(s: &mut TcpStream) -> std::result::Result<i64, Fail> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(i64::from_le_bytes(b))
}

fn read_value(s: &mut TcpStream) -> std::result::Result<Vec<u8>, Fail> {
    let n = read_i64(s)? as u64;
    if n > wire::MAX_VALUE {
        return Err(Fail::Io(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the server sent a value of {n} bytes (at most {})",
                wire::MAX_VALUE
            ),
        )));
    }
    let mut v = vec![0u8; n as usize];
    s.read_exact(&mut v)?;
    Ok(v)
}

impl TorchStore {
    /// Connect to the torch store at `addr` (`host:port`), retrying until
    /// `timeout`, then validate and ping.
    ///
    /// # Errors
    /// [`ErrorKind::Timeout`] naming the address when no server answered
    /// within `timeout`; [`ErrorKind::Io`] when the address does not resolve
    /// or the server is not a torch store.
    pub fn connect<A: ToSocketAddrs + fmt::Display>(
        addr: A,
        timeout: Duration,
    ) -> Result<TorchStore> {
        let store = TorchStore {
            addr: addr.to_string(),
            timeout: if timeout.is_zero() {
                Duration::from_millis(1)
            } else {
                timeout
            },
            control: Mutex::new(None),
            unsettled: AtomicBool::new(false),
            pool: Mutex::new(Vec::new()),
        };
        let deadline = Instant::now() + store.timeout;
        let mut delay = Duration::from_millis(10);
        let first = loop {
            match store.open(deadline) {
                Ok(s) => break s,
                Err(e)
                    if Instant::now() + delay < deadline
                        && !matches!(e.kind(), ErrorKind::InvalidConfig) =>
                {
                    tracing::debug!(addr = %store.addr, error = %e, "torch store: retrying the connection");
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
                Err(e) => return Err(e),
            }
        };
        *lock(&store.control) = Some(first);
        Ok(store)
    }

    fn resolve(&self) -> Result<Vec<SocketAddr>> {
        let addrs: Vec<SocketAddr> = self
            .addr
            .to_socket_addrs()
            .map_err(|e| {
                Error::invalid_config(
                    "torch store address",
                    &self.addr,
                    format!("does not resolve: {e}"),
                )
            })?
            .collect();
        if addrs.is_empty() {
            return Err(Error::invalid_config(
                "torch store address",
                &self.addr,
                "resolves to no address",
            ));
        }
        Ok(addrs)
    }

    /// One connection, validated and pinged, by `deadline`.
    fn open(&self, deadline: Instant) -> Result<TcpStream> {
        let mut last = None;
        for a in self.resolve()? {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            match TcpStream::connect_timeout(&a, left.min(CONNECT_ATTEMPT)) {
                Ok(mut s) => {
                    let _ = s.set_nodelay(true);
                    let hello = [
                        Msg::new(q::VALIDATE).u32(wire::MAGIC).into_bytes(),
                        Msg::new(q::PING).u32(std::process::id()).into_bytes(),
                    ]
                    .concat();
                    let io_bound = left.min(self.timeout).max(Duration::from_millis(1));
                    let res = (|| -> std::result::Result<u32, Fail> {
                        s.set_write_timeout(Some(io_bound))?;
                        s.set_read_timeout(Some(io_bound))?;
                        s.write_all(&hello)?;
                        let mut b = [0u8; 4];
                        s.read_exact(&mut b)?;
                        Ok(u32::from_le_bytes(b))
                    })();
                    match res {
                        Ok(n) if n == std::process::id() => return Ok(s),
                        Ok(n) => {
                            return Err(Error::new(
                                ErrorKind::Io,
                                format!("torch store {}: ping answered {n}, not {}: not a torch TCPStore server", self.addr, std::process::id()),
                            )
                            .with_fix(FIX_SERVER))
                        }
                        Err(f) => last = Some(self.fail("connect", f)),
                    }
                }
                Err(e) => last = Some(self.fail("connect", Fail::from(e))),
            }
        }
        Err(last.unwrap_or_else(|| {
            Error::new(
                ErrorKind::Io,
                format!("torch store {}: no address", self.addr),
            )
        }))
    }

    fn fail(&self, op: &str, f: Fail) -> Error {
        match f {
            Fail::Closed => Error::new(
                ErrorKind::PeerLost { peer: None },
                format!(
                    "torch store {}: the server closed the connection during {op}",
                    self.addr
                ),
            )
            .with_fix(FIX_SERVER),
            Fail::Io(e) if is_timeout(&e) => Error::timeout(
                format!("torch store {op}"),
                self.timeout,
                format!("torch store {} did not answer", self.addr),
            )
            .with_fix(FIX_SERVER),
            Fail::Io(e) => {
                Error::io(format!("torch store {} ({op})", self.addr), e).with_fix(FIX_SERVER)
            }
        }
    }

    /// Run `f` on the control connection (opened if needed); a failure
    /// drops the connection.
    fn control<T>(
        &self,
        op: &str,
        replies: bool,
        f: impl FnOnce(&mut TcpStream) -> std::result::Result<T, Fail>,
    ) -> Result<T> {
        let mut guard = lock(&self.control);
        if guard.is_none() {
            *guard = Some(self.open(Instant::now() + self.timeout)?);
        }
        let s = guard.as_mut().expect("opened above");
        let _ = s.set_read_timeout(Some(self.timeout));
        let _ = s.set_write_timeout(Some(self.timeout));
        match f(s) {
            Ok(v) => {
                self.unsettled.store(!replies, Ordering::SeqCst);
                Ok(v)
            }
            Err(e) => {
                *guard = None;
                Err(self.fail(op, e))
            }
        }
    }

    fn send(&self, op: &str, msg: Msg) -> Result<()> {
        let bytes = msg.into_bytes();
        self.control(op, false, |s| Ok(s.write_all(&bytes)?))
    }

    /// Make sure the server has applied every write sent so far.
    fn settle(&self) -> Result<()> {
        if self.unsettled.load(Ordering::SeqCst) {
            self.ping()?;
        }
        Ok(())
    }

    fn pooled(&self) -> Result<TcpStream> {
        self.settle()?;
        if let Some(s) = lock(&self.pool).pop() {
            return Ok(s);
        }
        self.open(Instant::now() + self.timeout)
    }

    fn give_back(&self, s: TcpStream) {
        let mut p = lock(&self.pool);
        if p.len() < POOL_MAX {
            p.push(s);
        }
    }

    /// `wait` on `s`: `Ok(true)` when the keys came, `Ok(false)` when
    /// `timeout` passed (the wait is then cancelled on the server).
    fn wait_on(
        &self,
        s: &mut TcpStream,
        request: Vec<u8>,
        timeout: Duration,
    ) -> std::result::Result<bool, Fail> {
        s.set_write_timeout(Some(self.timeout))?;
        s.write_all(&request)?;
        s.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
        let mut b = [0u8; 1];
        match s.read_exact(&mut b) {
            Ok(()) if b[0] == wire::STOP_WAITING => return Ok(true),
            Ok(()) => {
                return Err(Fail::Io(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("wait answered {}", b[0]),
                )))
            }
            Err(e) if is_timeout(&e) => {}
            Err(e) => return Err(e.into()),
        }
        s.set_read_timeout(Some(self.timeout))?;
        s.write_all(&Msg::new(q::CANCEL_WAIT).into_bytes())?;
        let mut answer = read_u8(s)?;
        if answer == wire::STOP_WAITING {
            // The keys came just before the cancel: its answer follows.
            answer = read_u8(s)?;
        }
        if answer != wire::WAIT_CANCELED {
            return Err(Fail::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("cancel_wait answered {answer}"),
            )));
        }
        Ok(false)
    }

    /// Run a blocking request on a pooled connection.
    fn blocking<T>(
        &self,
        op: &str,
        f: impl FnOnce(&mut TcpStream) -> std::result::Result<T, Fail>,
    ) -> Result<T> {
        let mut s = self.pooled()?;
        match f(&mut s) {
            Ok(v) => {
                self.give_back(s);
                Ok(v)
            }
            Err(e) => Err(self.fail(op, e)),
        }
    }

    fn keys_msg(query: u8, keys: &[&str]) -> Msg {
        keys.iter().fold(Msg::new(query).count(keys.len()), |m, k| {
            m.bytes(&prefixed(k))
        })
    }

    fn missing(&self, keys: &[&str]) -> Vec<String> {
        keys.iter()
            .filter(|k| !self.check(&[k]).unwrap_or(false))
            .map(|k| k.to_string())
            .collect()
    }

    /// Whether every key is set (or names a non-empty queue), without waiting.
    ///
    /// # Errors
    /// As every call: the server's address, when it cannot be reached.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        let m = Self::keys_msg(q::CHECK, keys).into_bytes();
        self.control("check", true, |s| {
            s.write_all(&m)?;
            Ok(read_u8(s)? == wire::READY)
        })
    }

    /// How many keys the server holds (every user's, not only this prefix).
    ///
    /// # Errors
    /// As [`check`](Self::check).
    pub fn num_keys(&self) -> Result<i64> {
        let m = Msg::new(q::NUM_KEYS).into_bytes();
        self.control("num_keys", true, |s| {
            s.write_all(&m)?;
            read_i64(s)
        })
    }

    /// Append `value` to the value of `key` (creating it).
    ///
    /// # Errors
    /// As [`check`](Self::check).
    pub fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        check_sizes("append", key, value)?;
        self.send(
            "append",
            Msg::new(q::APPEND).bytes(&prefixed(key)).bytes(value),
        )
    }

    /// Set several keys in one request.
    ///
    /// # Errors
    /// As [`check`](Self::check).
    pub fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        for (k, v) in pairs {
            check_sizes("multi_set", k, v)?;
        }
        let m = pairs
            .iter()
            .fold(Msg::new(q::MULTI_SET).count(pairs.len()), |m, (k, v)| {
                m.bytes(&prefixed(k)).bytes(v)
            });
        self.send("multi_set", m)
    }

    /// The values of several keys, waiting up to `timeout` for all of them.
    ///
    /// # Errors
    /// [`ErrorKind::Timeout`] naming the keys still missing.
    pub fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.wait(keys, timeout)?;
        let m = Self::keys_msg(q::MULTI_GET, keys).into_bytes();
        self.control("multi_get", true, |s| {
            s.write_all(&m)?;
            keys.iter().map(|_| read_value(s)).collect()
        })
    }

    /// A round trip to the server; how long it took.
    ///
    /// # Errors
    /// As [`check`](Self::check).
    pub fn ping(&self) -> Result<Duration> {
        let nonce = std::process::id() ^ 0x5A5A;
        let m = Msg::new(q::PING).u32(nonce).into_bytes();
        let start = Instant::now();
        let back = self.control("ping", true, |s| {
            s.write_all(&m)?;
            let mut b = [0u8; 4];
            s.read_exact(&mut b)?;
            Ok(u32::from_le_bytes(b))
        })?;
        if back != nonce {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "torch store {}: ping answered {back}, not {nonce}",
                    self.addr
                ),
            ));
        }
        Ok(start.elapsed())
    }

    /// Push `value` at the back of the queue `key`.
    ///
    /// # Errors
    /// As [`check`](Self::check).
    pub fn queue_push(&self, key: &str, value: &[u8]) -> Result<()> {
        check_sizes("queue_push", key, value)?;
        self.send(
            "queue_push",
            Msg::new(q::QUEUE_PUSH).bytes(&prefixed(key)).bytes(value),
        )
    }

    /// Pop the front of the queue `key`: `None` when it is empty, or with
    /// `block`, wait up to that long for an element first.
    ///
    /// # Errors
    /// [`ErrorKind::Timeout`] when `block` passed with the queue still empty.
    pub fn queue_pop(&self, key: &str, block: Option<Duration>) -> Result<Option<Vec<u8>>> {
        let k = prefixed(key);
        let pop = Msg::new(q::QUEUE_POP).bytes(&k).into_bytes();
        let read = |s: &mut TcpStream| -> std::result::Result<Option<Vec<u8>>, Fail> {
            s.write_all(&pop)?;
            if read_i64(s)? > 0 {
                Ok(Some(read_value(s)?))
            } else {
                Ok(None)
            }
        };
        match block {
            None => self.control("queue_pop", true, read),
            Some(t) => {
                let w = Self::keys_msg(q::WAIT, &[key]).into_bytes();
                let got = self.blocking("queue_pop", |s| {
                    if self.wait_on(s, w, t)? {
                        s.set_read_timeout(Some(self.timeout))?;
                        read(s)
                    } else {
                        Ok(None)
                    }
                })?;
                got.map(Some).ok_or_else(|| {
                    missing_keys_error(
                        "torch store queue_pop",
                        &[key.to_string()],
                        t,
                        &self.describe(),
                    )
                })
            }
        }
    }

    /// The length of the queue `key`.
    ///
    /// # Errors
    /// As [`check`](Self::check).
    pub fn queue_len(&self, key: &str) -> Result<i64> {
        let m = Msg::new(q::QUEUE_LEN).bytes(&prefixed(key)).into_bytes();
        self.control("queue_len", true, |s| {
            s.write_all(&m)?;
            read_i64(s)
        })
    }

    /// The keys the server holds under torch's prefix, without it.
    ///
    /// # Errors
    /// As [`check`](Self::check).
    pub fn list_keys(&self) -> Result<Vec<String>> {
        let m = Msg::new(q::LIST_KEYS).into_bytes();
        let raw = self.control("list_keys", true, |s| {
            s.write_all(&m)?;
            let n = read_i64(s)?.max(0) as u64;
            if n > wire::MAX_KEYS * 64 {
                return Err(Fail::Io(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{n} keys"),
                )));
            }
            (0..n)
                .map(|_| read_value(s))
                .collect::<std::result::Result<Vec<_>, _>>()
        })?;
        Ok(raw
            .into_iter()
            .filter_map(|k| {
                String::from_utf8(k)
                    .ok()?
                    .strip_prefix(KEY_PREFIX)
                    .map(str::to_string)
            })
            .collect())
    }

    /// torch's server-side barrier: returns once `world_size` callers
    /// reached `key`.
    ///
    /// # Errors
    /// [`ErrorKind::Timeout`] after `timeout`, saying how many arrived.
    pub fn server_barrier(&self, key: &str, world_size: i64, timeout: Duration) -> Result<()> {
        let m = Msg::new(q::BARRIER)
            .bytes(&prefixed(key))
            .i64(world_size)
            .into_bytes();
        if self.blocking("barrier", |s| self.wait_on(s, m, timeout))? {
            return Ok(());
        }
        let arrived = self
            .try_get(key)
            .ok()
            .flatten()
            .map(|v| String::from_utf8_lossy(&v).into_owned());
        Err(Error::timeout(
            "torch store barrier",
            timeout,
            format!(
                "{} of {world_size} arrived at barrier `{key}` on {}",
                arrived.as_deref().unwrap_or("?"),
                self.describe()
            ),
        ))
    }
}

/// Refuse what torch's server would close the connection for, before sending.
fn check_sizes(op: &str, key: &str, value: &[u8]) -> Result<()> {
    if (key.len() + KEY_PREFIX.len()) as u64 > wire::MAX_KEY || value.len() as u64 > wire::MAX_VALUE
    {
        return Err(Error::invalid_argument(
            format!("torch store {op}"),
            format!(
                "key `{}` ({} bytes) or its value ({} bytes) is over the torch store's limits ({} and {} bytes)",
                key.chars().take(64).collect::<String>(),
                key.len(),
                value.len(),
                wire::MAX_KEY - 1,
                wire::MAX_VALUE
            ),
        ));
    }
    Ok(())
}

impl Store for TorchStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_sizes("set", key, value)?;
        self.send("set", Msg::new(q::SET).bytes(&prefixed(key)).bytes(value))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let w = Self::keys_msg(q::WAIT, &[key]).into_bytes();
        let g = Msg::new(q::GET).bytes(&prefixed(key)).into_bytes();
        let got = self.blocking("get", |s| {
            if !self.wait_on(s, w, timeout)? {
                return Ok(None);
            }
            s.set_read_timeout(Some(self.timeout))?;
            s.write_all(&g)?;
            read_value(s).map(Some)
        })?;
        got.ok_or_else(|| {
            missing_keys_error("store get", &[key.to_string()], timeout, &self.describe())
        })
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let c = Self::keys_msg(q::CHECK, &[key]).into_bytes();
        let g = Msg::new(q::GET).bytes(&prefixed(key)).into_bytes();
        self.control("try_get", true, |s| {
            s.write_all(&c)?;
            if read_u8(s)? != wire::READY {
                return Ok(None);
            }
            s.write_all(&g)?;
            read_value(s).map(Some)
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let m = Msg::new(q::ADD)
            .bytes(&prefixed(key))
            .i64(delta)
            .into_bytes();
        match self.control("add", true, |s| {
            s.write_all(&m)?;
            read_i64(s)
        }) {
            Err(e) if matches!(e.kind(), ErrorKind::PeerLost { .. }) => {
                // torch's server closes the connection when the value is no
                // integer (ours also when the sum overflows): tell that apart
                // from a server that went away.
                let bad = match self.try_get(key) {
                    Ok(Some(v)) => std::str::from_utf8(&v)
                        .ok()
                        .and_then(|t| t.trim().parse::<i64>().ok())
                        .is_none_or(|c| c.checked_add(delta).is_none()),
                    _ => false,
                };
                if bad {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        format!("torch store {}: add {delta} to key `{key}`: it holds no integer, or the sum overflows", self.addr),
                    ));
                }
                Err(e)
            }
            r => r,
        }
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        let exp = expected.unwrap_or(&[]);
        let m = Msg::new(q::COMPARE_SET)
            .bytes(&prefixed(key))
            .bytes(exp)
            .bytes(new)
            .into_bytes();
        let now = self.control("compare_set", true, |s| {
            s.write_all(&m)?;
            read_value(s)
        })?;
        if now == new {
            // Swapped, unless the key was absent and `expected` (non-empty)
            // equals `new`: torch's server then echoes `expected`.
            if !exp.is_empty() && exp == new && !self.check(&[key])? {
                return Ok(CasOutcome::Current(None));
            }
            return Ok(CasOutcome::Swapped);
        }
        if !exp.is_empty() && now == exp {
            // Present and equal to `expected` would have been swapped: the
            // key is absent (torch's server echoes `expected` then).
            return Ok(CasOutcome::Current(None));
        }
        Ok(CasOutcome::Current(Some(now)))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let w = Self::keys_msg(q::WAIT, keys).into_bytes();
        if self.blocking("wait", |s| self.wait_on(s, w, timeout))? {
            return Ok(());
        }
        Err(missing_keys_error(
            "store wait",
            &self.missing(keys),
            timeout,
            &self.describe(),
        ))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let m = Msg::new(q::DELETE).bytes(&prefixed(key)).into_bytes();
        self.control("delete", true, |s| {
            s.write_all(&m)?;
            Ok(read_i64(s)? > 0)
        })
    }

    fn describe(&self) -> String {
        format!("torch://{}", self.addr)
    }
}
