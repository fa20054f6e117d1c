use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::{Error, ErrorKind, Store, StoreExt};

use super::conn::token_eq;
use super::wire::{read_frame, Request, Response, MAX_FRAME, PROTOCOL_VERSION};
use super::{ServerLimits, TcpStore, TcpStoreServer};
use crate::store_scenarios;
use crate::test_util::{self, capture_logs, wait_for_log};
use crate::testkit::Fixture;

const TOKEN: &str = "s3cret-token";
const T: Duration = Duration::from_secs(5);

fn server() -> TcpStoreServer {
    TcpStoreServer::bind_loopback(0, Some(TOKEN.into())).unwrap()
}

fn client(s: &TcpStoreServer) -> TcpStore {
    TcpStore::connect(s.local_addr(), Some(TOKEN), T).unwrap()
}

fn fixture() -> Fixture {
    let s = server();
    let c = client(&s);
    Fixture::new(Arc::new(c), s)
}

mod scenarios {
    use super::*;
    store_scenarios!(fixture());
}

mod prefixed_scenarios {
    use super::*;
    store_scenarios!(fixture().prefixed("run1/gloo"));
}

/// A port nothing listens on (bound, then released).
fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn raw_hello(addr: SocketAddr, token: Option<&str>) -> (TcpStream, Response) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(&Request::hello(token).encode().unwrap())
        .unwrap();
    let p = read_frame(&mut s, MAX_FRAME).unwrap();
    (s, Response::decode(&p).unwrap())
}

/// The server closes `s`: a read returns EOF (or a reset) within 5 s.
fn assert_closed(s: &mut TcpStream) {
    s.set_read_timeout(Some(T)).unwrap();
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => {}
        other => panic!("connection still open: {other:?}"),
    }
}

#[test]
fn stores_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<TcpStore>();
    check::<TcpStoreServer>();
    check::<crate::FileStore>();
    check::<crate::PrefixStore>();
    check::<crate::MemoryStore>();
}

#[test]
fn describe_is_a_tcp_url() {
    let s = server();
    let c = client(&s);
    assert_eq!(c.describe(), format!("tcp://{}", s.local_addr()));
    assert_eq!(s.url(), c.describe());
    let by_name = TcpStore::connect(
        format!("localhost:{}", s.local_addr().port()),
        Some(TOKEN),
        T,
    )
    .unwrap();
    assert_eq!(
        by_name.describe(),
        format!("tcp://localhost:{}", s.local_addr().port())
    );
    // Debug output never shows the token.
    assert!(!format!("{c:?} {s:?}").contains(TOKEN));
}

#[test]
fn server_state_is_shared_with_its_host() {
    let s = server();
    let c = client(&s);
    c.set("from-client", b"1").unwrap();
    assert_eq!(
        s.store().try_get("from-client").unwrap(),
        Some(b"1".to_vec())
    );
    s.store().set("from-host", b"2").unwrap();
    assert_eq!(c.get("from-host", T).unwrap(), b"2");
}

#[test]
fn many_clients_meet_at_a_barrier() {
    let s = server();
    let addr = s.local_addr();
    let hs: Vec<_> = (0..8)
        .map(|rank| {
            std::thread::spawn(move || {
                let c = TcpStore::connect(addr, Some(TOKEN), T).unwrap();
                c.set(&format!("rank/{rank}"), b"up").unwrap();
                c.barrier("start", 8, T).unwrap();
                let keys: Vec<String> = (0..8).map(|r| format!("rank/{r}")).collect();
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                c.wait(&refs, T).unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn a_blocked_get_does_not_stall_another_threads_set() {
    let s = server();
    let c = Arc::new(client(&s));
    let c2 = c.clone();
    let start = Instant::now();
    let waiter = std::thread::spawn(move || c2.get("later", Duration::from_secs(10)));
    std::thread::sleep(Duration::from_millis(100));
    // Same client object, another thread: must not queue behind the get.
    c.set("other", b"x").unwrap();
    assert_eq!(c.add("n", 1).unwrap(), 1);
    c.set("later", b"v").unwrap();
    assert_eq!(waiter.join().unwrap().unwrap(), b"v");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    // Two blocked calls at once, released together.
    let (a, b) = (c.clone(), c.clone());
    let h1 = std::thread::spawn(move || a.wait(&["go"], Duration::from_secs(10)));
    let h2 = std::thread::spawn(move || b.get("go", Duration::from_secs(10)));
    std::thread::sleep(Duration::from_millis(50));
    c.set("go", b"1").unwrap();
    h1.join().unwrap().unwrap();
    assert_eq!(h2.join().unwrap().unwrap(), b"1");
}

#[test]
fn wrong_token_is_refused_and_logged_with_the_peer() {
    capture_logs();
    let s = server();
    let start = Instant::now();
    let e = TcpStore::connect(s.local_addr(), Some("wrong"), Duration::from_secs(10)).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "refusal is not retried"
    );
    assert_eq!(e.kind(), &ErrorKind::Unauthorized, "{e}");
    let m = e.to_string();
    assert!(m.contains("refused") && m.contains("does not match"), "{m}");
    assert!(m.contains("ACCEL_RUN_TOKEN"), "{m}");
    assert!(m.contains(&s.local_addr().to_string()), "{m}");
    // The server names the peer it refused.
    let (mut raw, resp) = raw_hello(s.local_addr(), Some("also-wrong"));
    let peer = raw.local_addr().unwrap().to_string();
    assert!(matches!(resp, Response::Refused { .. }), "{resp:?}");
    assert_closed(&mut raw);
    let logged = wait_for_log(&["WARN", "refused", &peer]);
    assert!(!logged.is_empty(), "no warning naming {peer}");
}

#[test]
fn missing_token_is_refused() {
    let s = server();
    let e = TcpStore::connect(s.local_addr(), None, T).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Unauthorized, "{e}");
    assert!(e.to_string().contains("no run token"), "{e}");
    // An empty token counts as none.
    let e = TcpStore::connect(s.local_addr(), Some(""), T).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Unauthorized, "{e}");
    // A prefix of the token is not the token.
    let e = TcpStore::connect(s.local_addr(), Some(&TOKEN[..4]), T).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Unauthorized, "{e}");
}

#[test]
fn a_server_without_token_accepts_everyone() {
    let s = TcpStoreServer::bind_loopback(0, None).unwrap();
    TcpStore::connect(s.local_addr(), None, T)
        .unwrap()
        .set("a", b"1")
        .unwrap();
    let c = TcpStore::connect(s.local_addr(), Some("whatever"), T).unwrap();
    assert_eq!(c.get("a", T).unwrap(), b"1");
}

#[test]
fn token_comparison() {
    assert!(token_eq(b"abc", b"abc"));
    assert!(!token_eq(b"abc", b"abd"));
    assert!(!token_eq(b"abc", b"ab"));
    assert!(!token_eq(b"abc", b"abcd"));
    assert!(!token_eq(b"abc", b""));
    assert!(token_eq(b"", b""));
}

#[test]
fn connect_retries_until_the_server_starts() {
    let addr = free_port();
    let starter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        TcpStoreServer::bind(addr, Some(TOKEN.into())).unwrap()
    });
    let start = Instant::now();
    let c = TcpStore::connect(addr, Some(TOKEN), T).unwrap();
    assert!(start.elapsed() >= Duration::from_millis(250));
    let s = starter.join().unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(s.store().try_get("k").unwrap(), Some(b"v".to_vec()));
}

#[test]
fn connect_gives_up_naming_the_address() {
    let addr = free_port();
    let start = Instant::now();
    let e = TcpStore::connect(addr, Some(TOKEN), Duration::from_millis(300)).unwrap_err();
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
    let m = e.to_string();
    assert!(m.contains(&format!("tcp://{addr}")), "{m}");
    assert!(m.contains("MASTER_ADDR") && m.contains("refused"), "{m}");
}

#[test]
fn connecting_to_something_else_is_a_clear_error() {
    // A listener that answers every connection with an HTTP response.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        std::thread::sleep(Duration::from_millis(200));
    });
    let e = TcpStore::connect(addr, None, T).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidConfig, "{e}");
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
    h.join().unwrap();
}

/// A `get` of a key nobody sets, waiting on `c`, fails within 3 s of
/// `end` (which stops the server) with `PeerLost` or `Io`; its error.
fn a_waiting_get_fails_promptly(c: &Arc<TcpStore>, end: impl FnOnce()) -> Error {
    let c2 = c.clone();
    let waiter = std::thread::spawn(move || {
        let start = Instant::now();
        (c2.get("never", Duration::from_secs(20)), start.elapsed())
    });
    std::thread::sleep(Duration::from_millis(100));
    end();
    let (r, took) = waiter.join().unwrap();
    let e = r.unwrap_err();
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(
        matches!(e.kind(), ErrorKind::PeerLost { .. } | ErrorKind::Io),
        "{e}"
    );
    e
}

#[test]
fn shutdown_fails_a_waiting_client_promptly() {
    let s = server();
    let addr = s.local_addr();
    let c = Arc::new(client(&s));
    let e = a_waiting_get_fails_promptly(&c, || s.shutdown());
    assert!(e.to_string().contains(&format!("tcp://{addr}")), "{e}");
    // Later calls fail promptly too, on either connection kind.
    for r in [c.set("k", b"v").err(), c.get("k", T).err()] {
        let e = r.expect("call after shutdown must fail");
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
    }
    drop(s);
}

#[test]
fn a_killed_server_process_fails_every_call_promptly() {
    let mut child = test_util::spawn_entry(
        "tcp::tests::tcp_server_child",
        "tcp-server",
        &[("ACCEL_RDV_TEST_TOKEN", TOKEN)],
    );
    let addr = child.line_with("CHILD_ADDR=", Duration::from_secs(10));
    let c = Arc::new(TcpStore::connect(addr.as_str(), Some(TOKEN), T).unwrap());
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k", T).unwrap(), b"v");
    let e = a_waiting_get_fails_promptly(&c, || child.kill());
    assert!(e.to_string().contains(&addr), "{e}");
    for op in ["set", "try_get", "get", "add"] {
        let start = Instant::now();
        let r = match op {
            "set" => c.set("k", b"w").err(),
            "try_get" => c.try_get("k").err(),
            "get" => c.get("k", T).err(),
            _ => c.add("n", 1).err(),
        };
        let e = r.unwrap_or_else(|| panic!("{op} after the server died must fail"));
        assert!(start.elapsed() < T, "{op} took {:?}", start.elapsed());
        assert!(e.to_string().contains(&addr), "{op}: {e}");
    }
}

/// The child of `a_killed_server_process_fails_every_call_promptly`: a
/// server on loopback until killed; a no-op in the normal test run.
#[test]
fn tcp_server_child() {
    if test_util::child_role().as_deref() != Some("tcp-server") {
        return;
    }
    let token = std::env::var("ACCEL_RDV_TEST_TOKEN").ok();
    let server = TcpStoreServer::bind_loopback(0, token).unwrap();
    println!("CHILD_ADDR={}", server.local_addr());
    // Bounded: the parent kills us long before.
    std::thread::sleep(Duration::from_secs(30));
}

#[test]
fn oversized_frames_are_refused_and_the_server_survives() {
    let s = server();
    // After the hello: the server answers with an error and closes.
    let (mut raw, resp) = raw_hello(s.local_addr(), Some(TOKEN));
    assert_eq!(resp, Response::Ok);
    raw.write_all(&(MAX_FRAME + 1).to_le_bytes()).unwrap();
    let p = read_frame(&mut raw, MAX_FRAME).unwrap();
    match Response::decode(&p).unwrap() {
        Response::Error { message, .. } => assert!(message.contains("exceeds"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert_closed(&mut raw);
    // Before the hello a much smaller cap applies.
    let mut raw = TcpStream::connect(s.local_addr()).unwrap();
    raw.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
    assert_closed(&mut raw);
    // Garbage instead of a hello.
    let mut raw = TcpStream::connect(s.local_addr()).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert_closed(&mut raw);
    // A malformed request after the hello.
    let (mut raw, _) = raw_hello(s.local_addr(), Some(TOKEN));
    raw.write_all(&[2, 0, 0, 0, 0x7f, 0]).unwrap();
    let p = read_frame(&mut raw, MAX_FRAME).unwrap();
    assert!(matches!(
        Response::decode(&p).unwrap(),
        Response::Error { .. }
    ));
    assert_closed(&mut raw);
    // Other clients are unaffected.
    let c = client(&s);
    c.set("still", b"here").unwrap();
    assert_eq!(c.get("still", T).unwrap(), b"here");
}

#[test]
fn another_protocol_version_is_refused() {
    let s = server();
    let mut raw = TcpStream::connect(s.local_addr()).unwrap();
    raw.set_read_timeout(Some(T)).unwrap();
    let mut hello = Request::Hello {
        magic: super::wire::MAGIC,
        version: PROTOCOL_VERSION + 1,
        token: None,
    }
    .encode()
    .unwrap();
    // Version mismatch is decided before the token is read.
    hello.truncate(4 + 1 + 8 + 2);
    hello[..4].copy_from_slice(&11u32.to_le_bytes());
    raw.write_all(&hello).unwrap();
    let p = read_frame(&mut raw, MAX_FRAME).unwrap();
    assert_eq!(
        Response::decode(&p).unwrap(),
        Response::VersionMismatch {
            server_version: PROTOCOL_VERSION
        }
    );
    assert_closed(&mut raw);
}

#[test]
fn binding_all_interfaces_without_a_token_warns() {
    capture_logs();
    let s = TcpStoreServer::bind("0.0.0.0:0".parse().unwrap(), None).unwrap();
    let port = s.local_addr().port().to_string();
    let logged = wait_for_log(&["WARN", "without a run token", &port]);
    assert!(!logged.is_empty(), "no warning for an open server");
    // Shutdown works for an unspecified address too (wakes via loopback).
    let start = Instant::now();
    s.shutdown();
    assert!(start.elapsed() < Duration::from_secs(3));
    // With a token: no warning.
    let s = TcpStoreServer::bind("0.0.0.0:0".parse().unwrap(), Some(TOKEN.into())).unwrap();
    let port = s.local_addr().port().to_string();
    assert!(wait_for_log(&["WARN", "without a run token", &port]).is_empty());
}

#[test]
fn binding_a_taken_port_names_the_address() {
    let s = server();
    let e = TcpStoreServer::bind(s.local_addr(), None).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Io, "{e}");
    assert!(e.to_string().contains(&s.local_addr().to_string()), "{e}");
}

#[test]
fn from_listener_serves_a_socket_bound_by_the_caller() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let s = TcpStoreServer::from_listener(l, Some(TOKEN.into())).unwrap();
    assert_eq!(s.local_addr(), addr);
    let c = TcpStore::connect(addr, Some(TOKEN), T).unwrap();
    c.set("x", b"1").unwrap();
    drop(s);
    // Dropping the server frees the port.
    let e = c.try_get("x").unwrap_err();
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
    TcpListener::bind(addr).unwrap();
}

// ------------------------------------------------ bounded resources (issue 22, item 6)

fn server_with(limits: ServerLimits) -> TcpStoreServer {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    TcpStoreServer::from_listener_with(l, Some(TOKEN.into()), limits).unwrap()
}

/// Whether the server closed `s`, looking for at most `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

#[test]
fn a_trickled_hello_is_dropped_at_the_whole_handshake_deadline() {
    capture_logs();
    let s = server_with(ServerLimits {
        handshake_timeout: Duration::from_millis(300),
        ..ServerLimits::default()
    });
    // Announce a 1000-byte hello, then send one byte every 20 ms: each read
    // makes progress, so only a deadline on the whole hello ends it.
    let mut raw = TcpStream::connect(s.local_addr()).unwrap();
    let peer = raw.local_addr().unwrap().to_string();
    raw.write_all(&1000u32.to_le_bytes()).unwrap();
    let start = Instant::now();
    let mut dropped = false;
    for _ in 0..250 {
        if raw.write_all(&[1]).is_err() || closed_within(&mut raw, Duration::from_millis(20)) {
            dropped = true;
            break;
        }
    }
    assert!(
        dropped,
        "a client trickling its hello was still connected after {:?}",
        start.elapsed()
    );
    let logged = wait_for_log(&["WARN", "did not complete its hello", &peer]);
    assert!(!logged.is_empty(), "no warning about {peer}");
    // The server goes on serving.
    client(&s).set("k", b"v").unwrap();
}

#[test]
fn a_full_waiting_room_drops_its_oldest_connection_for_a_new_one() {
    let s = server_with(ServerLimits {
        max_handshakes: 2,
        ..ServerLimits::default()
    });
    let mut silent: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(s.local_addr()).unwrap())
        .collect();
    // Let the server accept both before the third arrives.
    std::thread::sleep(Duration::from_millis(100));
    // A real client still gets in: the oldest silent connection makes room.
    let c = client(&s);
    c.set("in", b"1").unwrap();
    assert!(
        closed_within(&mut silent[0], T),
        "the oldest connection in its hello was not dropped"
    );
    assert_eq!(c.get("in", T).unwrap(), b"1");
}

#[test]
fn past_the_connection_cap_a_client_is_told_busy_until_a_slot_frees() {
    let s = server_with(ServerLimits {
        max_connections: 2,
        ..ServerLimits::default()
    });
    let first = client(&s);
    first.set("a", b"1").unwrap();
    let (second, resp) = raw_hello(s.local_addr(), Some(TOKEN));
    assert_eq!(resp, Response::Ok);
    // The raw answer to a third hello is Busy, naming the limit.
    let (_raw, resp) = raw_hello(s.local_addr(), Some(TOKEN));
    match resp {
        Response::Busy { message } => assert!(message.contains("limit"), "{message}"),
        other => panic!("expected Busy, got {other:?}"),
    }
    // A client retries while its timeout lasts, then says why it gave up.
    let e = TcpStore::connect(s.local_addr(), Some(TOKEN), Duration::from_millis(500)).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("busy"), "{e}");
    // When a connection closes, a waiting client gets its slot.
    let waiting = std::thread::spawn({
        let addr = s.local_addr();
        move || TcpStore::connect(addr, Some(TOKEN), Duration::from_secs(10))
    });
    std::thread::sleep(Duration::from_millis(100));
    drop(second);
    let third = waiting.join().unwrap().unwrap();
    assert_eq!(third.try_get("a").unwrap().as_deref(), Some(&b"1"[..]));
}

#[test]
fn refusals_are_logged_a_few_at_a_time_then_counted() {
    capture_logs();
    let s = server();
    let addr = s.local_addr().to_string();
    for _ in 0..40 {
        let (mut raw, resp) = raw_hello(s.local_addr(), Some("wrong-token"));
        assert!(matches!(resp, Response::Refused { .. }), "{resp:?}");
        assert_closed(&mut raw);
    }
    let one_by_one = wait_for_log(&["WARN", "refused a connection", &addr]);
    assert!(
        (1..=5).contains(&one_by_one.len()),
        "{} refusal lines for 40 refusals: {one_by_one:#?}",
        one_by_one.len()
    );
    // The rest are counted in one line (at the end of the 10 s window, or
    // when the server stops).
    drop(s);
    let summary = wait_for_log(&["WARN", "more connections were refused or dropped", &addr]);
    assert_eq!(summary.len(), 1, "{summary:#?}");
    let counted = 40 - one_by_one.len();
    assert!(
        summary[0].contains(&format!("suppressed={counted}")),
        "{}",
        summary[0]
    );
}
